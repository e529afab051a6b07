// A shard's particles kept on the GPU between the steps of a simulation (fmm_gpu/resident.rs,
// docs/nbody.md "Forces on the GPU"): the leapfrog's drift and kick as kernels.
//
// Positions (kpc) and velocities (km/s) are double-float pairs (hi, lo) of f32 with
// hi + lo the value (about 48 significant bits): a step's small displacement is added to a
// position without being lost to f32's 24 bits. Sums are error-free transformations
// (Knuth's two-sum: additions only, so a compiler that fuses multiply-adds cannot change
// them). Shader compilers may rewrite float expressions algebraically where the source does
// not forbid it (Mesa's NIR turns `(a + b) - a` into `b` unless an operation is marked
// exact, and WGSL cannot mark one), which would make every error term 0: the intermediate
// sums pass through `opaque`, an XOR of their bits with a zero the compiler cannot see (a
// uniform), so no rewrite applies. Products are exact too (Dekker's split into 12-bit
// halves, its intermediates opaque as well; a compiler that fuses `ah * bh - p` only makes
// that term exact once more). Every invocation owns one particle: no atomics, the same bits
// on every run.
//
// Layout: pos[2 i] = (hi.xyz, mass), pos[2 i + 1] = (lo.xyz, 0) for i < capacity, vel the
// same without the mass; slots i >= num are padding, never read or written. A force
// evaluation's field[2 s], field[2 s + 1] are the (hi, lo) of (a / G, phi / G) at slot s of
// its order (the tree's for the FMM, the targets' for direct sums), perm[s] the shard index
// of slot s (>= num: an imported particle). Bindings 1 and 2 serve two kernels each:
// drift and kick read and write the velocities at 1 and read the field at 2; gather writes
// the FMM's sorted points at 1 and reads the imported particles' points at 2.

const WG: u32 = 64u;

struct Step {
    num: u32,
    slots: u32,
    // 0, from the host: see `opaque`.
    zero: u32,
    unused: u32,
    dt_hi: f32,
    dt_lo: f32,
    g_hi: f32,
    g_lo: f32,
    // The tree's cube centre (gather), (hi, lo).
    o_hi: vec4<f32>,
    o_lo: vec4<f32>,
}

@group(1) @binding(0) var<uniform> S: Step;

struct Df {
    hi: vec3<f32>,
    lo: vec3<f32>,
}

// x, with bits the compiler cannot relate to the expression that made x.
fn opaque(x: vec3<f32>) -> vec3<f32> {
    return bitcast<vec3<f32>>(bitcast<vec3<u32>>(x) ^ vec3<u32>(S.zero));
}

// a + b exactly as hi + lo (Knuth).
fn two_sum(a: vec3<f32>, b: vec3<f32>) -> Df {
    let s = opaque(a + b);
    let bb = opaque(s - a);
    return Df(s, (a - (s - bb)) + (b - bb));
}

// hi + lo with |lo| small against |hi| as a normalised pair (Dekker's fast two-sum).
fn renorm(hi: vec3<f32>, lo: vec3<f32>) -> Df {
    let s = opaque(hi + lo);
    return Df(s, lo - (s - hi));
}

fn add(a: Df, b: Df) -> Df {
    let s = two_sum(a.hi, b.hi);
    return renorm(s.hi, s.lo + (a.lo + b.lo));
}

// x as hi + lo with 12 significant bits each (Dekker's split; 4097 = 2^12 + 1).
fn split(x: vec3<f32>) -> Df {
    let t = opaque(4097.0 * x);
    let hi = opaque(t - opaque(t - x));
    return Df(hi, x - hi);
}

// a * b exactly as hi + lo (Dekker).
fn two_prod(a: vec3<f32>, b: f32) -> Df {
    let p = opaque(a * b);
    let x = split(a);
    let y = split(vec3<f32>(b));
    let e = ((x.hi * y.hi - p) + x.hi * y.lo + x.lo * y.hi) + x.lo * y.lo;
    return Df(p, e);
}

// a * (bh + bl) for a scalar pair (bh, bl).
fn mul(a: Df, bh: f32, bl: f32) -> Df {
    let p = two_prod(a.hi, bh);
    return renorm(p.hi, p.lo + (a.hi * bl + a.lo * bh));
}

fn index(wg: vec3<u32>, lid: u32) -> u32 {
    return (wg.x + wg.y * 65535u) * WG + lid;
}

// x += v dt for the shard's particles.
@compute @workgroup_size(64)
fn drift(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let i = index(wg, lid);
    if i >= S.num { return; }
    let hi = pos_at(2u * i);
    let x = Df(hi.xyz, pos_at(2u * i + 1u).xyz);
    let v = Df(vel_or_points_at(2u * i).xyz, vel_or_points_at(2u * i + 1u).xyz);
    let y = add(x, mul(v, S.dt_hi, S.dt_lo));
    pos_set(2u * i, vec4<f32>(y.hi, hi.w));
    pos_set(2u * i + 1u, vec4<f32>(y.lo, 0.0));
}

// v += G (field) dt, slot by slot of the force evaluation's order.
@compute @workgroup_size(64)
fn kick(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let s = index(wg, lid);
    if s >= S.slots { return; }
    let i = perm_at(s);
    if i >= S.num { return; }
    let f = Df(field_or_imported_at(2u * s).xyz, field_or_imported_at(2u * s + 1u).xyz);
    let a = mul(f, S.g_hi, S.g_lo);
    let v = Df(vel_or_points_at(2u * i).xyz, vel_or_points_at(2u * i + 1u).xyz);
    let w = add(v, mul(a, S.dt_hi, S.dt_lo));
    vel_or_points_set(2u * i, vec4<f32>(w.hi, 0.0));
    vel_or_points_set(2u * i + 1u, vec4<f32>(w.lo, 0.0));
}

// The FMM's sorted points (fmm.wgsl's `pts`): slot s holds particle perm[s] relative to the
// tree's cube centre as (hi, lo) with the mass in hi's 4th component; imported particles
// (perm[s] >= num) come packed that way from the host.
@compute @workgroup_size(64)
fn gather(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let s = index(wg, lid);
    if s >= S.slots { return; }
    let i = perm_at(s);
    if i >= S.num {
        let k = i - S.num;
        vel_or_points_set(2u * s, field_or_imported_at(2u * k));
        vel_or_points_set(2u * s + 1u, field_or_imported_at(2u * k + 1u));
        return;
    }
    let hi = pos_at(2u * i);
    let d = add(Df(hi.xyz, pos_at(2u * i + 1u).xyz), Df(-S.o_hi.xyz, -S.o_lo.xyz));
    vel_or_points_set(2u * s, vec4<f32>(d.hi, hi.w));
    vel_or_points_set(2u * s + 1u, vec4<f32>(d.lo, 0.0));
}
