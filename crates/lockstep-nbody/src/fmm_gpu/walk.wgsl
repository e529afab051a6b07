// The FMM's dual tree walk on the GPU (fmm_gpu/walk.rs, docs/nbody.md "Forces on the
// GPU"): the interaction lists of `Fmm::walk_lists` (the host's walk, fmm/mod.rs) built on
// the device, breadth first, as compressed rows per target node.
//
// The walk visits pairs (target node a, source b) from (root, root) and from (root, cell)
// for every imported cell. Each pair either records one list entry (M2L, M2P or P2P), or
// splits into child pairs (a's children with b, a with b's children, or every pair of a's
// children when a = b), or ends: the host walk's rules, pair by pair (`decide`). The pairs
// of one step are the frontier: a count kernel writes each pair's children and entries,
// two exclusive scans turn the counts into offsets, and a write kernel puts the children
// into the next frontier and the entries after the previous steps'. The entries are then
// sorted by (kind, target) with a stable radix sort, which keeps the walk's order within a
// row, and cut into rows by binary search. Every step is a fixed sequence of dispatches;
// frontier sizes stay on the device (indirect dispatches), so the whole walk is one
// submission. No atomics: every result has one writer, the same bits on every run.
//
// Opening test in double-float arithmetic (pairs (hi, lo) of f32, about 48 bits): centres
// relative to the tree's cube centre and radii as the host's f64 values split in two, the
// test (r_a + r_b)^2 < theta^2 d^2, so the decisions are the host's except within about
// 2^-46 of the boundary. The error terms pass through `opq` (an XOR with a zero from the
// host) so that no compiler rewrites them away (see resident.wgsl).
//
// Pairs are (a, b | mode << 30): mode 0 the walk, 1 the direct sums of every target leaf
// under a with node b (the host's `p2p_leaves`), 2 a against imported cell b. Entries are
// (kind << kb | a, b), kind 0 M2L, 1 M2P, 2 P2P, with bit 31 of b set on a forced M2P (an
// imported cell that failed the opening test at a leaf).

const MASK: u32 = 0x3fffffffu;
const FORCED: u32 = 0x80000000u;

// meta words.
const M_FSIZE: u32 = 0u;
const M_FNEXT: u32 = 1u;
const M_EBASE: u32 = 2u;
const M_ECOUNT: u32 = 3u;
const M_FLAG: u32 = 4u;
const M_NEED_F: u32 = 5u;
const M_NEED_E: u32 = 6u;
const M_MAXF: u32 = 7u;
const M_BASE: u32 = 8u; // first sorted entry of each kind (3 words)
const M_PAIRS: u32 = 12u; // pairs the walk visited (low, high words)
const M_STATS: u32 = 16u; // longest M2L, M2P, P2P row; most P2P row particles; forced; pairs lo, hi

// ---- nodes ----

fn radius(k: u32) -> Df { return Df(geo_at(2u * k).w, geo_at(2u * k + 1u).w); }

// (r_a + r_b)^2 < theta^2 |c_a - c_b|^2: the host's r_a + r_b < theta d.
fn separated(a: u32, b: u32, ra: Df, rb: Df) -> bool {
    let ah = geo_at(2u * a).xyz;
    let al = geo_at(2u * a + 1u).xyz;
    let bh = geo_at(2u * b).xyz;
    let bl = geo_at(2u * b + 1u).xyz;
    var d2 = Df(0.0, 0.0);
    for (var c = 0u; c < 3u; c++) {
        let d = add(Df(ah[c], al[c]), Df(-bh[c], -bl[c]));
        d2 = add(d2, mul(d, d));
    }
    let s = add(ra, rb);
    return less(mul(s, s), mul(Df(R.th2_hi, R.th2_lo), d2));
}

// ca * cb <= direct_max without overflow.
fn few(ca: u32, cb: u32) -> bool {
    return cb == 0u || ca <= R.direct_max / cb;
}

// What pair (a, bm) does: `entry` 0 M2L, 1 M2P, 2 P2P, 3 forced M2P, 4 none; `split` 1 a's
// children with b, 2 a with b's children, 3 every pair of a's children; the children's
// mode; `nc` children.
struct Dec { entry: u32, split: u32, mode: u32, nc: u32 }

fn decide(a: u32, bm: u32) -> Dec {
    let mode = bm >> 30u;
    let b = bm & MASK;
    var d = Dec(4u, 0u, mode, 0u);
    let na = nodes_at(2u * a);
    if nodes_at(2u * a + 1u).y == 0u { return d; }
    let leaf_a = na.w == 0u;
    if mode == 1u {
        if leaf_a { d.entry = 2u; } else { d.split = 1u; d.nc = na.w; }
        return d;
    }
    let ra = radius(a);
    if mode == 2u {
        let rc = radius(b);
        let far = separated(a, b, ra, rc);
        if far || leaf_a {
            if !far { d.entry = 3u; } else if leaf_a && less(rc, ra) { d.entry = 1u; } else { d.entry = 0u; }
        } else {
            d.split = 1u;
            d.nc = na.w;
        }
        return d;
    }
    if a == b {
        if leaf_a { d.entry = 2u; } else { d.split = 3u; d.nc = na.w * na.w; }
        return d;
    }
    let nb = nodes_at(2u * b);
    let leaf_b = nb.w == 0u;
    let ca = na.y - na.x;
    let cb = nb.y - nb.x;
    let rb = radius(b);
    if separated(a, b, ra, rb) {
        let small = few(ca, cb);
        if small && !leaf_a {
            d.split = 1u;
            d.nc = na.w;
        } else if leaf_a && small {
            d.entry = 2u;
        } else if leaf_a && less(rb, ra) {
            d.entry = 1u;
        } else {
            d.entry = 0u;
        }
        return d;
    }
    if leaf_a && leaf_b {
        d.entry = 2u;
    } else if leaf_a {
        if cb <= R.p2p_node_max { d.entry = 2u; } else { d.split = 2u; d.nc = nb.w; }
    } else if leaf_b {
        d.split = 1u;
        d.nc = na.w;
        if ca <= R.p2p_node_max { d.mode = 1u; }
    } else {
        let equal = ra.hi == rb.hi && ra.lo == rb.lo;
        if less(rb, ra) || (equal && a > b) {
            d.split = 1u;
            d.nc = na.w;
        } else {
            d.split = 2u;
            d.nc = nb.w;
        }
    }
    return d;
}

fn front_at(i: u32) -> vec2<u32> {
    if R.parity == 0u { return front_a_at(i); }
    return front_b_at(i);
}

fn front_put(i: u32, v: vec2<u32>) {
    if R.parity == 0u { front_b_set(i, v); } else { front_a_set(i, v); }
}

// Children and entries of each pair of the frontier: counts at s0 + i and s1 + i.
@compute @workgroup_size(64)
fn walk_count(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = flat(wg, lid, WG);
    if i >= meta_at(M_FSIZE) { return; }
    let p = front_at(i);
    let d = decide(p.x, p.y);
    scan_set(R.s0 + i, d.nc);
    scan_set(R.s1 + i, u32(d.entry < 4u));
}

// After the scans (totals at s0 and s1): the next frontier's size and where this step's
// entries go. A frontier over its capacity stops the walk (bit 0 of the flag; the host runs
// it again with more room); entries over theirs (bit 1) are counted but not written, so
// that the walk ends with the exact number the next run needs.
@compute @workgroup_size(1)
fn walk_next() {
    // Totals of NONE: the scans saturated (more than 32-bit indices reach).
    let nc = scan_at(R.s0);
    let ne = scan_at(R.s1);
    let ebase = meta_at(M_ECOUNT);
    let ecount = ebase + ne;
    var flag = meta_at(M_FLAG);
    if nc > R.cap_f {
        flag |= 1u;
        meta_set(M_NEED_F, max(meta_at(M_NEED_F), nc));
    }
    // A count past 2^32 wraps: it needs more than a u32 index.
    let wrapped = ecount < ebase || ne == NONE;
    if wrapped || ecount > R.cap_e { flag |= 2u; }
    meta_set(M_NEED_E, max(meta_at(M_NEED_E), select(ecount, NONE, wrapped)));
    meta_set(M_FLAG, flag);
    meta_set(M_EBASE, ebase);
    meta_set(M_ECOUNT, ecount);
    if (flag & 1u) != 0u {
        meta_set(M_FNEXT, 0u);
        return;
    }
    meta_set(M_FNEXT, nc);
    meta_set(M_MAXF, max(meta_at(M_MAXF), nc));
}

// Children into the next frontier (offsets at s0 + i), entries after the earlier steps'
// (offsets at s1 + i).
@compute @workgroup_size(64)
fn walk_write(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = flat(wg, lid, WG);
    let flag = meta_at(M_FLAG);
    if i >= meta_at(M_FSIZE) || (flag & 1u) != 0u { return; }
    let p = front_at(i);
    let a = p.x;
    let b = p.y & MASK;
    let d = decide(a, p.y);
    if d.entry < 4u {
        if flag != 0u { return; }
        let kind = min(d.entry, 1u + u32(d.entry == 2u));
        var src = b;
        if d.entry == 3u { src |= FORCED; }
        ent_a_set(meta_at(M_EBASE) + scan_at(R.s1 + i), vec2<u32>((kind << R.kb) | a, src));
        return;
    }
    var o = scan_at(R.s0 + i);
    let na = nodes_at(2u * a);
    if d.split == 1u {
        for (var c = 0u; c < na.w; c++) {
            front_put(o + c, vec2<u32>(na.z + c, b | (d.mode << 30u)));
        }
    } else if d.split == 2u {
        let nb = nodes_at(2u * b);
        for (var c = 0u; c < nb.w; c++) {
            front_put(o + c, vec2<u32>(a, nb.z + c));
        }
    } else if d.split == 3u {
        for (var x = 0u; x < na.w; x++) {
            for (var y = 0u; y < na.w; y++) {
                front_put(o, vec2<u32>(na.z + x, na.z + y));
                o += 1u;
            }
        }
    }
}

// The next step's frontier and its dispatch sizes (copied by the host into the indirect
// arguments buffer).
@compute @workgroup_size(1)
fn walk_advance() {
    let n = meta_at(M_FNEXT);
    meta_set(M_FSIZE, n);
    let lo = meta_at(M_PAIRS) + n;
    meta_set(M_PAIRS + 1u, meta_at(M_PAIRS + 1u) + u32(lo < n));
    meta_set(M_PAIRS, lo);
    put_sizes(n);
}

// ---- rows ----

// First sorted entry (of `count`, in ent_a) with key >= v.
fn lower_bound(v: u32) -> u32 {
    var lo = 0u;
    var hi = R.count;
    while lo < hi {
        let mid = (lo + hi) / 2u;
        if ent_a_at(mid).x < v { lo = mid + 1u; } else { hi = mid; }
    }
    return lo;
}

// Row offsets: out[count + k (nn + 1) + t] for kind k and node t <= nn, relative to the
// kind's first entry; the kinds' first entries to meta.
@compute @workgroup_size(64)
fn rows(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let q = flat(wg, lid, WG);
    if q >= 3u * (R.nn + 1u) { return; }
    let k = q / (R.nn + 1u);
    let t = q % (R.nn + 1u);
    let base = lower_bound(k << R.kb);
    out_set(R.count + q, lower_bound((k << R.kb) | t) - base);
    if t == 0u { meta_set(M_BASE + k, base); }
}

// The sources of the sorted entries, in order: out[i], without the forced bit.
@compute @workgroup_size(64)
fn items(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = flat(wg, lid, WG);
    if i >= R.count { return; }
    out_set(i, ent_a_at(i).y & ~FORCED);
}

// ---- what the host plans with ----
//
// Per node: its rows' lengths, its P2P row's source particles and pairs, its forced M2P
// entries; reduced per workgroup of 256 to 8 words at s0 + 8 * block (`stats_block`), then
// over the blocks into meta (`stats_final`, one workgroup).

var<workgroup> st: array<u32, 2048>;

fn st_reduce(lid: u32) {
    for (var half = SCAN / 2u; half > 0u; half >>= 1u) {
        if lid < half {
            let o = (lid + half) * 8u;
            for (var w = 0u; w < 4u; w++) { st[lid * 8u + w] = max(st[lid * 8u + w], st[o + w]); }
            st[lid * 8u + 4u] += st[o + 4u];
            let lo = st[lid * 8u + 5u] + st[o + 5u];
            st[lid * 8u + 6u] += st[o + 6u] + u32(lo < st[o + 5u]);
            st[lid * 8u + 5u] = lo;
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(256)
fn stats_block(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let blk = wg.x + wg.y * 65535u;
    let t = blk * SCAN + lid;
    for (var w = 0u; w < 8u; w++) { st[lid * 8u + w] = 0u; }
    if t < R.nn {
        let n1 = R.nn + 1u;
        for (var k = 0u; k < 3u; k++) {
            st[lid * 8u + k] = out_at(R.count + k * n1 + t + 1u) - out_at(R.count + k * n1 + t);
        }
        let m2p0 = meta_at(M_BASE + 1u);
        var forced = 0u;
        for (var e = out_at(R.count + n1 + t); e < out_at(R.count + n1 + t + 1u); e++) {
            forced += u32((ent_a_at(m2p0 + e).y & FORCED) != 0u);
        }
        let p2p0 = meta_at(M_BASE + 2u);
        var sources = 0u;
        for (var e = out_at(R.count + 2u * n1 + t); e < out_at(R.count + 2u * n1 + t + 1u); e++) {
            let nb = nodes_at(2u * out_at(p2p0 + e));
            sources += nb.y - nb.x;
        }
        let na = nodes_at(2u * t);
        let hi_lo = two_prod_u32(na.y - na.x, sources);
        st[lid * 8u + 3u] = sources;
        st[lid * 8u + 4u] = forced;
        st[lid * 8u + 5u] = hi_lo.x;
        st[lid * 8u + 6u] = hi_lo.y;
    }
    workgroupBarrier();
    st_reduce(lid);
    if lid == 0u {
        for (var w = 0u; w < 8u; w++) { scan_set(R.s0 + blk * 8u + w, st[w]); }
    }
}

// a * b as (low, high) 32-bit words.
fn two_prod_u32(a: u32, b: u32) -> vec2<u32> {
    let a0 = a & 0xffffu;
    let a1 = a >> 16u;
    let b0 = b & 0xffffu;
    let b1 = b >> 16u;
    let p00 = a0 * b0;
    let mid = a1 * b0 + (p00 >> 16u);
    let mid2 = a0 * b1 + (mid & 0xffffu);
    let lo = (mid2 << 16u) | (p00 & 0xffffu);
    let hi = a1 * b1 + (mid >> 16u) + (mid2 >> 16u);
    return vec2<u32>(lo, hi);
}

@compute @workgroup_size(256)
fn stats_final(@builtin(local_invocation_index) lid: u32) {
    for (var w = 0u; w < 8u; w++) { st[lid * 8u + w] = 0u; }
    // The blocks lid, lid + 256, ... folded into this invocation's slot in block order.
    for (var b = lid; b < R.len; b += SCAN) {
        for (var w = 0u; w < 4u; w++) { st[lid * 8u + w] = max(st[lid * 8u + w], scan_at(R.s0 + b * 8u + w)); }
        st[lid * 8u + 4u] += scan_at(R.s0 + b * 8u + 4u);
        let x = scan_at(R.s0 + b * 8u + 5u);
        let lo = st[lid * 8u + 5u] + x;
        st[lid * 8u + 6u] += scan_at(R.s0 + b * 8u + 6u) + u32(lo < x);
        st[lid * 8u + 5u] = lo;
    }
    workgroupBarrier();
    st_reduce(lid);
    if lid == 0u {
        for (var w = 0u; w < 7u; w++) { meta_set(M_STATS + w, st[w]); }
    }
}
