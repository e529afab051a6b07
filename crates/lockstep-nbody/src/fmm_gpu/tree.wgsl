// The FMM's Morton tree built on the GPU from a resident shard's positions (fmm_gpu/tree.rs,
// docs/nbody.md "Forces on the GPU"), the nodes the host's `Tree::build_nodes_in` builds in
// the same cube (fmm/tree.rs): bounding box, Morton keys, a stable radix sort of the keys,
// the nodes level by level and their centres of mass and radii.
//
// - Cube: a power of two side at least 1 + 2^-10 times the bounding box's largest extent
//   (1 for a point), its corner 2^-30 sides below the box's; keys are floor((x - corner) *
//   2^21 / side) per axis, exact for the double-float difference (the side is a power of
//   two), so a key differs from the host's f64 one only within about 2^-47 of a cell edge.
// - Sort: 63-bit keys as (low, high) words, sorted by the low word then, stably, by the high
//   word: (key, particle) pairs in the host's order.
// - Nodes: breadth first, level by level as the host's `subdivide`: a node of more than
//   `leaf` particles above the keys' last level splits into its non-empty octants (binary
//   searches on its sorted keys); per level a count, a scan and a write, the level's size
//   on the device (indirect dispatches), so the whole build is one submission.
// - Geometry: each node's particles in chunks of 1,024 (one workgroup each, so a large node
//   is many workgroups), the chunks' sums then combined per node in chunk order: mass,
//   centre of mass (the box's centre when massless), then the largest distance from it
//   (the radius), in double-float arithmetic in a fixed order.
//
// Positions are the shard's (hi, lo) pairs (resident.wgsl); centres and radii are written
// as the walk and the FMM kernels read them: geo[2k] = (centre hi relative to the cube's
// centre, radius hi), geo[2k + 1] = (centre lo, radius lo).

const BITS: u32 = 21u;
const BOUNDS_WG: u32 = 128u;

// meta words (M_ARGS..M_ARGS + 12 the next dispatch sizes per item and scan level, then
// the geometry's per chunk).
const T_LS: u32 = 0u; // first node of each level, 23 words
const T_GEO_ARGS: u32 = 44u;
const T_CNT: u32 = 48u; // nodes of each level, 23 words
const T_FLAG: u32 = 72u;
const T_NEED: u32 = 73u;
const T_TOTAL: u32 = 74u;
const T_CHUNKS: u32 = 75u;

// fl: the cube, then the bounding box's partial reductions (4 vec4 each).
const F_LO: u32 = 0u; // (corner hi, side)
const F_LO2: u32 = 1u; // (corner lo, 2^21 / side)
const F_ORIGIN: u32 = 2u; // (centre hi, 1 if a position is not finite)
const F_ORIGIN2: u32 = 3u; // (centre lo, 0)

struct D3 { hi: vec3<f32>, lo: vec3<f32> }

fn opq3(x: vec3<f32>) -> vec3<f32> {
    return bitcast<vec3<f32>>(bitcast<vec3<u32>>(x) ^ vec3<u32>(R.zero));
}

fn add3(a: D3, b: D3) -> D3 {
    let s = opq3(a.hi + b.hi);
    let bb = opq3(s - a.hi);
    let e = (a.hi - opq3(s - bb)) + (b.hi - bb) + (a.lo + b.lo);
    let t = opq3(s + e);
    return D3(t, e - opq3(t - s));
}

fn neg3(a: D3) -> D3 { return D3(-a.hi, -a.lo); }

fn comp(a: D3, c: u32) -> Df { return Df(a.hi[c], a.lo[c]); }

// Lexicographic (hi, lo) comparison per component: the order of the values.
fn lt3(ah: vec3<f32>, al: vec3<f32>, bh: vec3<f32>, bl: vec3<f32>) -> vec3<bool> {
    return (ah < bh) | ((ah == bh) & (al < bl));
}

fn inf() -> f32 { return bitcast<f32>(0x7f800000u); }

fn point(i: u32) -> D3 { return D3(pos_at(2u * i).xyz, pos_at(2u * i + 1u).xyz); }

// ---- bounding box ----

var<workgroup> bx: array<vec4<f32>, 512>;

// Reduces the (min, max) pairs of this workgroup's invocations into fl at `s1 + 4 b`, with
// in the first vec4's 4th component whether any of them saw a coordinate that is not finite.
// `items` is the count reduced over: a workgroup past its last box (the 2D fold of a large
// dispatch) writes nothing.
fn reduce_box(lid: u32, b: u32, items: u32, mn: D3, mx: D3, bad: f32) {
    bx[4u * lid] = vec4<f32>(mn.hi, bad);
    bx[4u * lid + 1u] = vec4<f32>(mn.lo, 0.0);
    bx[4u * lid + 2u] = vec4<f32>(mx.hi, 0.0);
    bx[4u * lid + 3u] = vec4<f32>(mx.lo, 0.0);
    workgroupBarrier();
    for (var half = BOUNDS_WG / 2u; half > 0u; half >>= 1u) {
        if lid < half {
            let o = 4u * (lid + half);
            let m = 4u * lid;
            let lt = lt3(bx[o].xyz, bx[o + 1u].xyz, bx[m].xyz, bx[m + 1u].xyz);
            bx[m] = vec4<f32>(select(bx[m].xyz, bx[o].xyz, lt), max(bx[m].w, bx[o].w));
            bx[m + 1u] = vec4<f32>(select(bx[m + 1u].xyz, bx[o + 1u].xyz, lt), 0.0);
            let gt = lt3(bx[m + 2u].xyz, bx[m + 3u].xyz, bx[o + 2u].xyz, bx[o + 3u].xyz);
            bx[m + 2u] = vec4<f32>(select(bx[m + 2u].xyz, bx[o + 2u].xyz, gt), 0.0);
            bx[m + 3u] = vec4<f32>(select(bx[m + 3u].xyz, bx[o + 3u].xyz, gt), 0.0);
        }
        workgroupBarrier();
    }
    if lid == 0u && b * BOUNDS_WG < items {
        for (var w = 0u; w < 4u; w++) { fl_set(R.s1 + 4u * b + w, bx[w]); }
    }
}

// The box of particles b * 128 .. (b + 1) * 128 (of `count`) into fl at s1 + 4 b.
@compute @workgroup_size(128)
fn bounds_first(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let b = wg.x + wg.y * 65535u;
    let i = b * BOUNDS_WG + lid;
    var mn = D3(vec3<f32>(inf()), vec3<f32>(0.0));
    var mx = D3(vec3<f32>(-inf()), vec3<f32>(0.0));
    var bad = 0.0;
    if i < R.count {
        mn = point(i);
        mx = mn;
        // Not finite: the exponent's bits all set (inf or NaN).
        let e = bitcast<vec3<u32>>(mn.hi) & vec3<u32>(0x7f800000u);
        bad = select(0.0, 1.0, any(e == vec3<u32>(0x7f800000u)));
    }
    reduce_box(lid, b, R.count, mn, mx, bad);
}

// The box of boxes b * 128 .. (b + 1) * 128 (of `len`, at s0) into fl at s1 + 4 b.
@compute @workgroup_size(128)
fn bounds_more(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let b = wg.x + wg.y * 65535u;
    let i = b * BOUNDS_WG + lid;
    var mn = D3(vec3<f32>(inf()), vec3<f32>(0.0));
    var mx = D3(vec3<f32>(-inf()), vec3<f32>(0.0));
    var bad = 0.0;
    if i < R.len {
        let at = R.s0 + 4u * i;
        mn = D3(fl_at(at).xyz, fl_at(at + 1u).xyz);
        mx = D3(fl_at(at + 2u).xyz, fl_at(at + 3u).xyz);
        bad = fl_at(at).w;
    }
    reduce_box(lid, b, R.len, mn, mx, bad);
}

// The smallest power of two at least v (> 0, normal).
fn pow2_at_least(v: f32) -> f32 {
    let b = bitcast<u32>(v);
    var e = b & 0x7f800000u;
    if (b & 0x007fffffu) != 0u { e += 0x00800000u; }
    return bitcast<f32>(e);
}

// The cube from the box at s0 (one entry).
@compute @workgroup_size(1)
fn cube() {
    let mn = D3(fl_at(R.s0).xyz, fl_at(R.s0 + 1u).xyz);
    let mx = D3(fl_at(R.s0 + 2u).xyz, fl_at(R.s0 + 3u).xyz);
    let e = (mx.hi - mn.hi) + (mx.lo - mn.lo);
    let ext = max(e.x, max(e.y, e.z));
    // 1 for a point (as the host's cube), at least 2^-100 so that 2^21 / side stays a
    // normal float.
    var side = 1.0;
    if ext > 0.0 { side = max(pow2_at_least(ext * 1.0009765625), 7.888609052210118e-31); }
    let pad = side * 9.313225746154785e-10; // 2^-30
    let lo = add3(mn, D3(vec3<f32>(-pad), vec3<f32>(0.0)));
    let centre = add3(lo, D3(vec3<f32>(0.5 * side), vec3<f32>(0.0)));
    let e_side = (bitcast<u32>(side) >> 23u) & 0xffu;
    let inv_cell = bitcast<f32>((148u + 127u - e_side) << 23u); // 2^21 / side
    fl_set(F_LO, vec4<f32>(lo.hi, side));
    fl_set(F_LO2, vec4<f32>(lo.lo, inv_cell));
    // Whether a position was not finite, or the extent overflowed f32, for the host.
    let bad = max(fl_at(R.s0).w, select(0.0, 1.0, side >= inf()));
    fl_set(F_ORIGIN, vec4<f32>(centre.hi, bad));
    fl_set(F_ORIGIN2, vec4<f32>(centre.lo, 0.0));
}

// ---- keys and their sort ----

// Particle i's key as (low, high) words, and (low word, i) for the sort.
@compute @workgroup_size(64)
fn keys(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = flat(wg, lid, WG);
    if i >= R.count { return; }
    let c0 = fl_at(F_LO);
    let c1 = fl_at(F_LO2);
    let d = add3(point(i), D3(-c0.xyz, -c1.xyz));
    let vh = d.hi * c1.w;
    let vl = d.lo * c1.w;
    var f = floor(vh);
    f -= select(vec3<f32>(0.0), vec3<f32>(1.0), (f == vh) & (vl < vec3<f32>(0.0)));
    let q = vec3<u32>(clamp(f, vec3<f32>(0.0), vec3<f32>(2097151.0)));
    var lo = 0u;
    var hi = 0u;
    for (var j = 0u; j < BITS; j++) {
        for (var c = 0u; c < 3u; c++) {
            let bit = (q[c] >> j) & 1u;
            let p = 3u * j + 2u - c;
            if p < 32u { lo |= bit << p; } else { hi |= bit << (p - 32u); }
        }
    }
    keys_set(i, vec2<u32>(lo, hi));
    ent_a_set(i, vec2<u32>(lo, i));
}

// After the low word's passes: (high word, particle) for the high word's.
@compute @workgroup_size(64)
fn regather(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let j = flat(wg, lid, WG);
    if j >= R.count { return; }
    let i = ent_a_at(j).y;
    ent_a_set(j, vec2<u32>(keys_at(i).y, i));
}

// The sorted keys (ent_b, as (low, high)) and the permutation.
@compute @workgroup_size(64)
fn sorted(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let j = flat(wg, lid, WG);
    if j >= R.count { return; }
    let i = ent_a_at(j).y;
    ent_b_set(j, keys_at(i));
    perm_set(j, i);
}

// ---- nodes, level by level ----

// The octant digit of sorted key s at `shift` (a multiple of 3 below 63).
fn octant(s: u32, shift: u32) -> u32 {
    let k = ent_b_at(s);
    if shift >= 32u { return (k.y >> (shift - 32u)) & 7u; }
    if shift <= 29u { return (k.x >> shift) & 7u; }
    return ((k.x >> shift) | (k.y << (32u - shift))) & 7u;
}

// Boundaries b[o] of the octants o of node range [start, end) at level l.
fn octants(start: u32, end: u32, l: u32) -> array<u32, 9> {
    var b: array<u32, 9>;
    b[0] = start;
    b[8] = end;
    let shift = 3u * (BITS - 1u - l);
    var first = start;
    for (var o = 1u; o < 8u; o++) {
        var lo = first;
        var hi = end;
        while lo < hi {
            let mid = (lo + hi) / 2u;
            if octant(mid, shift) < o { lo = mid + 1u; } else { hi = mid; }
        }
        b[o] = lo;
        first = lo;
    }
    return b;
}

fn splits(a: vec4<u32>, l: u32) -> bool {
    return a.y - a.x > R.leaf && l < BITS;
}

// Children of each node of level R.level: counts at s0 + i.
@compute @workgroup_size(64)
fn split_count(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = flat(wg, lid, WG);
    let l = R.level;
    if i >= meta_at(T_CNT + l) { return; }
    let a = nodes_at(2u * (meta_at(T_LS + l) + i));
    var c = 0u;
    if splits(a, l) {
        let b = octants(a.x, a.y, l);
        for (var o = 0u; o < 8u; o++) { c += u32(b[o + 1u] > b[o]); }
    }
    scan_set(R.s0 + i, c);
}

// After the scan (total at s1): the next level's range and dispatch sizes; a level beyond
// the node capacity stops the build (the host builds again with the size needed).
@compute @workgroup_size(1)
fn level_next() {
    let l = R.level;
    let le = meta_at(T_LS + l + 1u);
    var total = scan_at(R.s1);
    if meta_at(T_FLAG) != 0u {
        total = 0u;
    } else if le + total > R.cap_f {
        meta_set(T_FLAG, 1u);
        meta_set(T_NEED, le + total);
        total = 0u;
    }
    meta_set(T_LS + l + 2u, le + total);
    meta_set(T_CNT + l + 1u, total);
    meta_set(T_TOTAL, le + total);
    put_sizes(total);
}

// The children of each node of level R.level (first child at s0 + i, exclusive).
@compute @workgroup_size(64)
fn split_write(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = flat(wg, lid, WG);
    let l = R.level;
    if i >= meta_at(T_CNT + l) || meta_at(T_FLAG) != 0u { return; }
    let k = meta_at(T_LS + l) + i;
    let a = nodes_at(2u * k);
    if !splits(a, l) { return; }
    let b = octants(a.x, a.y, l);
    let first = meta_at(T_LS + l + 1u) + scan_at(R.s0 + i);
    var c = first;
    for (var o = 0u; o < 8u; o++) {
        if b[o + 1u] > b[o] {
            nodes_set(2u * c, vec4<u32>(b[o], b[o + 1u], 0u, 0u));
            nodes_set(2u * c + 1u, vec4<u32>(k, 0u, l + 1u, 0u));
            c += 1u;
        }
    }
    nodes_set(2u * k, vec4<u32>(a.x, a.y, first, c - first));
}

// ---- geometry, in chunks of CH particles ----
//
// After the levels: `chunk_prep` sizes the per-node dispatches for all nodes; `chunk_count`
// writes each node's chunks (at least one) at s0 + k, a scan gives each node its first
// chunk, `chunk_total` sizes the per-chunk dispatches. Then `geo_sums` (a workgroup per
// chunk: mass, moment, box and targets of its particles), `geo_centre` (per node, its chunks
// in order), `geo_reach` (per chunk, the largest squared distance from the centre) and
// `geo_radius` (per node) write `geo` and the nodes' target counts. A chunk's 7 vec4 of
// partial sums are in `part`.

const CH: u32 = 1024u;

fn chunks_of(a: vec4<u32>) -> u32 {
    return max(1u, (a.y - a.x + CH - 1u) / CH);
}

@compute @workgroup_size(1)
fn chunk_prep() {
    let t = meta_at(T_TOTAL);
    put_sizes(t);
}

@compute @workgroup_size(64)
fn chunk_count(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let k = flat(wg, lid, WG);
    if k >= meta_at(T_TOTAL) { return; }
    scan_set(R.s0 + k, chunks_of(nodes_at(2u * k)));
}

// After the scan (total at s1).
@compute @workgroup_size(1)
fn chunk_total() {
    let c = scan_at(R.s1);
    meta_set(T_CHUNKS, c);
    put_args(T_GEO_ARGS, c, 1u);
}

// The node of chunk j: the last k with first chunk <= j.
fn node_of_chunk(j: u32) -> u32 {
    var lo = 0u;
    var hi = meta_at(T_TOTAL);
    while lo < hi {
        let mid = (lo + hi) / 2u;
        if scan_at(R.s0 + mid) <= j { lo = mid + 1u; } else { hi = mid; }
    }
    return lo - 1u;
}

// Chunk j's particles [i0, i1) and its node k.
struct Chunk { k: u32, i0: u32, i1: u32 }

fn chunk(j: u32) -> Chunk {
    if j >= meta_at(T_CHUNKS) { return Chunk(0u, 0u, 0u); }
    let k = node_of_chunk(j);
    let a = nodes_at(2u * k);
    let i0 = a.x + (j - scan_at(R.s0 + k)) * CH;
    return Chunk(k, i0, min(a.y, i0 + CH));
}

var<workgroup> gm: array<vec2<f32>, 64>;
var<workgroup> gn: array<u32, 64>;
var<workgroup> gv: array<vec4<f32>, 384>;

fn mul3s(x: D3, w: f32) -> D3 {
    var h: vec3<f32>;
    var l: vec3<f32>;
    for (var c = 0u; c < 3u; c++) {
        let p = mul(comp(x, c), Df(w, 0.0));
        h[c] = p.hi;
        l[c] = p.lo;
    }
    return D3(h, l);
}

// a / b for double-floats (one Newton step from the f32 quotient).
fn div(a: Df, b: Df) -> Df {
    let q1 = a.hi / b.hi;
    let r = add(a, mul(Df(-q1, 0.0), b));
    return renorm(q1, r.hi / b.hi);
}

// sqrt(a) for a double-float a >= 0.
fn sqrt_df(a: Df) -> Df {
    if a.hi <= 0.0 { return Df(0.0, 0.0); }
    let s = sqrt(a.hi);
    let r = add(a, mul(Df(-s, 0.0), Df(s, 0.0)));
    return renorm(s, r.hi / (2.0 * s));
}

fn origin() -> D3 { return D3(fl_at(F_ORIGIN).xyz, fl_at(F_ORIGIN2).xyz); }

// Mass, moment, box and target count of chunk j's particles, relative to the cube's centre.
@compute @workgroup_size(64)
fn geo_sums(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let j = wg.x + wg.y * 65535u;
    let ch = chunk(j);
    let o = origin();
    var m = Df(0.0, 0.0);
    var mom = D3(vec3<f32>(0.0), vec3<f32>(0.0));
    var mn = D3(vec3<f32>(inf()), vec3<f32>(0.0));
    var mx = D3(vec3<f32>(-inf()), vec3<f32>(0.0));
    var nt = 0u;
    for (var s = ch.i0 + lid; s < ch.i1; s += WG) {
        let i = perm_at(s);
        let x = add3(point(i), neg3(o));
        let w = pos_at(2u * i).w;
        m = add(m, Df(w, 0.0));
        mom = add3(mom, mul3s(x, w));
        let lt = lt3(x.hi, x.lo, mn.hi, mn.lo);
        mn = D3(select(mn.hi, x.hi, lt), select(mn.lo, x.lo, lt));
        let gt = lt3(mx.hi, mx.lo, x.hi, x.lo);
        mx = D3(select(mx.hi, x.hi, gt), select(mx.lo, x.lo, gt));
        nt += u32(i < R.n_targets);
    }
    gm[lid] = vec2<f32>(m.hi, m.lo);
    gn[lid] = nt;
    gv[6u * lid] = vec4<f32>(mom.hi, 0.0);
    gv[6u * lid + 1u] = vec4<f32>(mom.lo, 0.0);
    gv[6u * lid + 2u] = vec4<f32>(mn.hi, 0.0);
    gv[6u * lid + 3u] = vec4<f32>(mn.lo, 0.0);
    gv[6u * lid + 4u] = vec4<f32>(mx.hi, 0.0);
    gv[6u * lid + 5u] = vec4<f32>(mx.lo, 0.0);
    workgroupBarrier();
    for (var half = WG / 2u; half > 0u; half >>= 1u) {
        if lid < half {
            let p = lid + half;
            let ms = add(Df(gm[lid].x, gm[lid].y), Df(gm[p].x, gm[p].y));
            gm[lid] = vec2<f32>(ms.hi, ms.lo);
            gn[lid] += gn[p];
            combine(6u * lid, 6u * p);
        }
        workgroupBarrier();
    }
    if lid == 0u && j < meta_at(T_CHUNKS) {
        // The count as a float: exact (at most 1,024), and never a subnormal.
        part_set(7u * j, vec4<f32>(gm[0].x, gm[0].y, f32(gn[0]), 0.0));
        for (var w = 0u; w < 6u; w++) { part_set(7u * j + 1u + w, gv[w]); }
    }
}

// gv[a..a + 6] = (moment, min, max) of gv[a..] and gv[b..] combined.
fn combine(a: u32, b: u32) {
    let ms3 = add3(D3(gv[a].xyz, gv[a + 1u].xyz), D3(gv[b].xyz, gv[b + 1u].xyz));
    gv[a] = vec4<f32>(ms3.hi, 0.0);
    gv[a + 1u] = vec4<f32>(ms3.lo, 0.0);
    let lt = lt3(gv[b + 2u].xyz, gv[b + 3u].xyz, gv[a + 2u].xyz, gv[a + 3u].xyz);
    gv[a + 2u] = vec4<f32>(select(gv[a + 2u].xyz, gv[b + 2u].xyz, lt), 0.0);
    gv[a + 3u] = vec4<f32>(select(gv[a + 3u].xyz, gv[b + 3u].xyz, lt), 0.0);
    let gt = lt3(gv[a + 4u].xyz, gv[a + 5u].xyz, gv[b + 4u].xyz, gv[b + 5u].xyz);
    gv[a + 4u] = vec4<f32>(select(gv[a + 4u].xyz, gv[b + 4u].xyz, gt), 0.0);
    gv[a + 5u] = vec4<f32>(select(gv[a + 5u].xyz, gv[b + 5u].xyz, gt), 0.0);
}

// Node k's centre from its chunks' sums, in chunk order, and its target count.
@compute @workgroup_size(64)
fn geo_centre(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let k = flat(wg, lid, WG);
    if k >= meta_at(T_TOTAL) { return; }
    let a = nodes_at(2u * k);
    let j0 = scan_at(R.s0 + k);
    var m = Df(0.0, 0.0);
    var mom = D3(vec3<f32>(0.0), vec3<f32>(0.0));
    var mn = D3(vec3<f32>(inf()), vec3<f32>(0.0));
    var mx = D3(vec3<f32>(-inf()), vec3<f32>(0.0));
    var nt = 0u;
    for (var j = j0; j < j0 + chunks_of(a); j++) {
        let p = part_at(7u * j);
        m = add(m, Df(p.x, p.y));
        nt += u32(p.z);
        mom = add3(mom, D3(part_at(7u * j + 1u).xyz, part_at(7u * j + 2u).xyz));
        let cmn = D3(part_at(7u * j + 3u).xyz, part_at(7u * j + 4u).xyz);
        let lt = lt3(cmn.hi, cmn.lo, mn.hi, mn.lo);
        mn = D3(select(mn.hi, cmn.hi, lt), select(mn.lo, cmn.lo, lt));
        let cmx = D3(part_at(7u * j + 5u).xyz, part_at(7u * j + 6u).xyz);
        let gt = lt3(mx.hi, mx.lo, cmx.hi, cmx.lo);
        mx = D3(select(mx.hi, cmx.hi, gt), select(mx.lo, cmx.lo, gt));
    }
    var c = D3(vec3<f32>(0.0), vec3<f32>(0.0));
    if m.hi > 0.0 {
        var h: vec3<f32>;
        var l: vec3<f32>;
        for (var q = 0u; q < 3u; q++) {
            let v = div(comp(mom, q), m);
            h[q] = v.hi;
            l[q] = v.lo;
        }
        c = D3(h, l);
    } else if a.y > a.x {
        let s = add3(mn, mx);
        c = D3(0.5 * s.hi, 0.5 * s.lo);
    }
    geo_set(2u * k, vec4<f32>(c.hi, 0.0));
    geo_set(2u * k + 1u, vec4<f32>(c.lo, 0.0));
    let b = nodes_at(2u * k + 1u);
    nodes_set(2u * k + 1u, vec4<u32>(b.x, nt, b.z, 0u));
}

// The largest squared distance of chunk j's particles from its node's centre.
@compute @workgroup_size(64)
fn geo_reach(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let j = wg.x + wg.y * 65535u;
    let ch = chunk(j);
    let o = origin();
    let c = D3(geo_at(2u * ch.k).xyz, geo_at(2u * ch.k + 1u).xyz);
    var r2 = Df(0.0, 0.0);
    for (var s = ch.i0 + lid; s < ch.i1; s += WG) {
        let d = add3(add3(point(perm_at(s)), neg3(o)), neg3(c));
        var q = Df(0.0, 0.0);
        for (var a = 0u; a < 3u; a++) {
            let da = comp(d, a);
            q = add(q, mul(da, da));
        }
        if less(r2, q) { r2 = q; }
    }
    gm[lid] = vec2<f32>(r2.hi, r2.lo);
    workgroupBarrier();
    for (var half = WG / 2u; half > 0u; half >>= 1u) {
        if lid < half {
            let p = lid + half;
            if less(Df(gm[lid].x, gm[lid].y), Df(gm[p].x, gm[p].y)) { gm[lid] = gm[p]; }
        }
        workgroupBarrier();
    }
    if lid == 0u && j < meta_at(T_CHUNKS) {
        part_set(7u * j, vec4<f32>(gm[0].x, gm[0].y, 0.0, 0.0));
    }
}

// Node k's radius: the largest of its chunks'.
@compute @workgroup_size(64)
fn geo_radius(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let k = flat(wg, lid, WG);
    if k >= meta_at(T_TOTAL) { return; }
    let j0 = scan_at(R.s0 + k);
    var r2 = Df(0.0, 0.0);
    for (var j = j0; j < j0 + chunks_of(nodes_at(2u * k)); j++) {
        let p = part_at(7u * j);
        if less(r2, Df(p.x, p.y)) { r2 = Df(p.x, p.y); }
    }
    let r = sqrt_df(r2);
    let h = geo_at(2u * k);
    let l = geo_at(2u * k + 1u);
    geo_set(2u * k, vec4<f32>(h.xyz, r.hi));
    geo_set(2u * k + 1u, vec4<f32>(l.xyz, r.lo));
}
