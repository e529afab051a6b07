// Kernels shared by the N-body GPU modules that build the tree's lists and (later) the tree
// itself (fmm_gpu/sort_scan.rs): the dispatch record, double-float arithmetic, exclusive
// scans of up to four levels of 256, and a stable radix sort of (key, value) pairs. A
// module's WGSL is this file followed by its own (`walk.wgsl`), and its storage arrays
// include `scan`, `meta`, `ent_a` and `ent_b` (fmm_gpu/walk.rs). No atomics anywhere: every
// result has one writer, the same bits on every run.

const WG: u32 = 64u;
const SCAN: u32 = 256u;
const NONE: u32 = 0xffffffffu;
// Where a module keeps the next step's indirect dispatch sizes in its meta array: per item
// (WG), scan levels 0, 1, 2: (x, y, z) each, copied by the host into the arguments buffer.
const M_ARGS: u32 = 32u;

struct Rec {
    nn: u32, zero: u32, direct_max: u32, p2p_node_max: u32,
    th2_hi: f32, th2_lo: f32, parity: u32, cap_f: u32,
    cap_e: u32, pass_bits: u32, ntiles: u32, kb: u32,
    s0: u32, s1: u32, s2: u32, s3: u32,
    s_level: u32, len: u32, len_word: u32, count: u32,
    s_top: u32, leaf: u32, level: u32, n_targets: u32,
}

@group(1) @binding(0) var<uniform> R: Rec;

fn flat(wg: vec3<u32>, lid: u32, size: u32) -> u32 {
    return (wg.x + wg.y * 65535u) * size + lid;
}

// ---- double-float arithmetic ----

struct Df { hi: f32, lo: f32 }

fn opq(x: f32) -> f32 { return bitcast<f32>(bitcast<u32>(x) ^ R.zero); }

fn two_sum(a: f32, b: f32) -> Df {
    let s = opq(a + b);
    let bb = opq(s - a);
    return Df(s, (a - opq(s - bb)) + (b - bb));
}

fn renorm(hi: f32, lo: f32) -> Df {
    let s = opq(hi + lo);
    return Df(s, lo - opq(s - hi));
}

fn add(a: Df, b: Df) -> Df {
    let s = two_sum(a.hi, b.hi);
    return renorm(s.hi, s.lo + (a.lo + b.lo));
}

fn split(x: f32) -> Df {
    let t = opq(4097.0 * x);
    let hi = opq(t - opq(t - x));
    return Df(hi, x - hi);
}

fn two_prod(a: f32, b: f32) -> Df {
    let p = opq(a * b);
    let x = split(a);
    let y = split(b);
    return Df(p, ((x.hi * y.hi - p) + x.hi * y.lo + x.lo * y.hi) + x.lo * y.lo);
}

fn mul(a: Df, b: Df) -> Df {
    let p = two_prod(a.hi, b.hi);
    return renorm(p.hi, p.lo + (a.hi * b.lo + a.lo * b.hi));
}

fn less(a: Df, b: Df) -> bool {
    return a.hi < b.hi || (a.hi == b.hi && a.lo < b.lo);
}

// Workgroups (x, y, 1) for `n` items of `size` each, at most 65,535 in x.
fn put_args(at: u32, n: u32, size: u32) {
    let g = (n + size - 1u) / size;
    meta_set(at, min(g, 65535u));
    meta_set(at + 1u, max(1u, (g + 65534u) / 65535u));
    meta_set(at + 2u, 1u);
}

// The next dispatches' sizes for n items at M_ARGS: per item (WG) and per scan level (the
// host's `sizes` in sort_scan.rs).
fn put_sizes(n: u32) {
    put_args(M_ARGS, n, WG);
    put_args(M_ARGS + 3u, n, SCAN);
    put_args(M_ARGS + 6u, n, SCAN * SCAN);
    put_args(M_ARGS + 9u, n, SCAN * SCAN * SCAN);
}

// ---- exclusive scan in place, up to four levels of 256 ----
//
// Level j holds ceil(len / 256^j) entries at s_j (s0..s3); `scan_up` at level j scans each
// block of 256 in place and writes the block's total to level j + 1 (the top level s_top,
// one block, writes the grand total after its 256 entries); `scan_down` adds level j + 1's
// scanned totals back. The host uses as few levels as the capacity needs.

var<workgroup> ss: array<u32, 256>;

fn seg_len(level: u32) -> u32 {
    var n = R.len;
    if R.len_word != NONE { n = meta_at(R.len_word); }
    for (var j = 0u; j < level; j++) { n = (n + SCAN - 1u) / SCAN; }
    return n;
}

fn seg_off(level: u32) -> u32 {
    if level == 0u { return R.s0; }
    if level == 1u { return R.s1; }
    if level == 2u { return R.s2; }
    return R.s3;
}

@compute @workgroup_size(256)
fn scan_up(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let blk = wg.x + wg.y * 65535u;
    let lv = R.s_level;
    let n = seg_len(lv);
    let off = seg_off(lv);
    var up = seg_off(lv) + SCAN;
    if lv < R.s_top { up = seg_off(lv + 1u); }
    let i = blk * SCAN + lid;
    var v = 0u;
    if i < n { v = scan_at(off + i); }
    ss[lid] = v;
    workgroupBarrier();
    for (var d = 1u; d < SCAN; d <<= 1u) {
        var t = ss[lid];
        if lid >= d {
            // Saturating: a sum past 2^32 - 1 stays NONE up to the grand total, which the
            // caller reads as an overflow.
            let u = t + ss[lid - d];
            t = select(u, NONE, u < t || ss[lid - d] == NONE);
        }
        workgroupBarrier();
        ss[lid] = t;
        workgroupBarrier();
    }
    if i < n { scan_set(off + i, ss[lid] - v); }
    if lid == SCAN - 1u && blk * SCAN < max(n, 1u) { scan_set(up + blk, ss[lid]); }
}

@compute @workgroup_size(256)
fn scan_down(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let blk = wg.x + wg.y * 65535u;
    let lv = R.s_level;
    let i = blk * SCAN + lid;
    if i >= seg_len(lv) { return; }
    let off = seg_off(lv);
    scan_set(off + i, scan_at(off + i) + scan_at(seg_off(lv + 1u) + blk));
}

// ---- stable radix sort of the entries by key, 4 bits per pass ----
//
// Tile t of 4,096 entries, 16 consecutive ones per invocation: `sort_count` writes its count
// of each digit d at s0 + d * ntiles + t (digit-major, so an exclusive scan gives each
// (digit, tile) its first place), and `sort_scatter` moves each entry to that place plus its
// rank among the tile's entries of its digit before it. The ranks come from one scan over
// the tile's invocations of their digit counts, packed 16 bits per digit in 8 words, and a
// running count within each invocation's 16 entries: no atomics, the order within a digit
// kept, and 16 entries per step of the scan's barriers.

const PER: u32 = 16u;
const TILE: u32 = 4096u;

var<workgroup> oh: array<u32, 2048>;

fn ent_src(i: u32) -> vec2<u32> {
    if R.parity == 0u { return ent_a_at(i); }
    return ent_b_at(i);
}

fn ent_dst(i: u32, v: vec2<u32>) {
    if R.parity == 0u { ent_b_set(i, v); } else { ent_a_set(i, v); }
}

fn digit_of(i: u32) -> u32 {
    if i >= R.count { return 16u; }
    return (ent_src(i).x >> R.pass_bits) & 15u;
}

fn field(c: array<u32, 8>, d: u32) -> u32 {
    return (c[d >> 1u] >> (16u * (d & 1u))) & 0xffffu;
}

// This invocation's digit counts (packed) over its 16 entries of tile t.
fn own_counts(t: u32, lid: u32) -> array<u32, 8> {
    var c: array<u32, 8>;
    for (var j = 0u; j < PER; j++) {
        let d = digit_of(t * TILE + lid * PER + j);
        if d < 16u { c[d >> 1u] += 1u << (16u * (d & 1u)); }
    }
    return c;
}

// Inclusive scan over the tile's invocations of their packed counts `c`: the counts of
// invocations 0..=lid.
fn tile_scan(lid: u32, c: array<u32, 8>) -> array<u32, 8> {
    for (var w = 0u; w < 8u; w++) { oh[lid * 8u + w] = c[w]; }
    workgroupBarrier();
    for (var off = 1u; off < SCAN; off <<= 1u) {
        var t: array<u32, 8>;
        for (var w = 0u; w < 8u; w++) {
            t[w] = oh[lid * 8u + w];
            if lid >= off { t[w] += oh[(lid - off) * 8u + w]; }
        }
        workgroupBarrier();
        for (var w = 0u; w < 8u; w++) { oh[lid * 8u + w] = t[w]; }
        workgroupBarrier();
    }
    var out: array<u32, 8>;
    for (var w = 0u; w < 8u; w++) { out[w] = oh[lid * 8u + w]; }
    return out;
}

@compute @workgroup_size(256)
fn sort_count(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wg.x + wg.y * 65535u;
    let all = tile_scan(lid, own_counts(t, lid));
    if lid == SCAN - 1u && t < R.ntiles {
        for (var d = 0u; d < 16u; d++) {
            scan_set(R.s0 + d * R.ntiles + t, field(all, d));
        }
    }
}

@compute @workgroup_size(256)
fn sort_scatter(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let t = wg.x + wg.y * 65535u;
    let own = own_counts(t, lid);
    let incl = tile_scan(lid, own);
    // Entries of each digit before this invocation's (no field borrows: incl >= own).
    var run: array<u32, 8>;
    for (var w = 0u; w < 8u; w++) { run[w] = incl[w] - own[w]; }
    for (var j = 0u; j < PER; j++) {
        let i = t * TILE + lid * PER + j;
        let d = digit_of(i);
        // t < ntiles: a workgroup past the last tile (the 2D fold) writes nothing.
        if d < 16u && t < R.ntiles {
            ent_dst(scan_at(R.s0 + d * R.ntiles + t) + field(run, d), ent_src(i));
            run[d >> 1u] += 1u << (16u * (d & 1u));
        }
    }
}
