// The Poisson draws and the after-spike currents' jump in 32-bit types only, for adapters
// without SHADER_INT64 or SHADER_F64 (wide_arith.rs): appended after the header (`alias
// wide = f32;`), before `bptt.wgsl`. The same functions as `with_64bit.wgsl`:
// * the draws give the CPU's counts bit for bit: splitmix64 on (low, high) pairs of u32,
//   and the inversion as integer thresholds on the uniform number's 53 bits, computed on
//   the host from the CPU's float64 recurrence (`input::poisson_thresholds`);
// * the jump is computed in double-float32 (an error of about 2^-47 of the larger of `amp`
//   and `ad * refr_decay`) and rounded once to float32: the CPU's float32 except where the
//   exact value lies that close to a rounding midpoint (more often where the two nearly
//   cancel).

// A 64-bit integer as (low, high) words.
fn add64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let lo = a.x + b.x;
    return vec2<u32>(lo, a.y + b.y + select(0u, 1u, lo < a.x));
}

// x >> s for 0 < s < 32.
fn shr64(x: vec2<u32>, s: u32) -> vec2<u32> {
    return vec2<u32>((x.x >> s) | (x.y << (32u - s)), x.y >> s);
}

// The 64-bit product of two 32-bit integers, from 16-bit halves.
fn mul32x32(a: u32, b: u32) -> vec2<u32> {
    let a0 = a & 0xffffu;
    let a1 = a >> 16u;
    let b0 = b & 0xffffu;
    let b1 = b >> 16u;
    let p00 = a0 * b0;
    let p01 = a0 * b1;
    let p10 = a1 * b0;
    let mid = (p00 >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
    let lo = (p00 & 0xffffu) | (mid << 16u);
    let hi = a1 * b1 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u);
    return vec2<u32>(lo, hi);
}

// The low 64 bits of a * b.
fn mul64(a: vec2<u32>, b: vec2<u32>) -> vec2<u32> {
    let p = mul32x32(a.x, b.x);
    return vec2<u32>(p.x, p.y + a.x * b.y + a.y * b.x);
}

fn splitmix64(x: vec2<u32>) -> vec2<u32> {
    var z = add64(x, vec2<u32>(0x7F4A7C15u, 0x9E3779B9u));
    z = mul64(z ^ shr64(z, 30u), vec2<u32>(0x1CE4E5B9u, 0xBF58476Du));
    z = mul64(z ^ shr64(z, 27u), vec2<u32>(0x133111EBu, 0x94D049BBu));
    return z ^ shr64(z, 31u);
}

// The 53-bit integer m of `input::keyed_uniform`'s number m 2^-53 keyed by (seed, sample,
// node, step).
fn keyed_unit_steps(seed: vec2<u32>, sample: vec2<u32>, node: u32, t: u32) -> vec2<u32> {
    var x = splitmix64(seed ^ vec2<u32>(0xED0F1A57u, 0x005Eu));
    x = splitmix64(x ^ sample);
    x = splitmix64(x ^ mul32x32(node, 0x9E3779B9u));
    x = splitmix64(x ^ vec2<u32>(t, 0u));
    return shr64(x, 11u);
}

// The Poisson count of Poisson node p (virtual node v) in sample l at step t: the count of
// the node's first threshold pair (`O_PTHR`, from `O_PTPTR + p`) above m.
fn poisson_count(p: u32, v: u32, l: u32, t: u32) -> u32 {
    let seed = vec2<u32>(net_u32_at(O_SEED), net_u32_at(O_SEED + 1u));
    let s0 = vec2<u32>(net_u32_at(O_S0), net_u32_at(O_S0 + 1u));
    let m = keyed_unit_steps(seed, add64(s0, vec2<u32>(l, 0u)), v, t);
    let j0 = net_u32_at(O_PTPTR + p);
    let j1 = net_u32_at(O_PTPTR + p + 1u);
    for (var j = j0; j < j1; j = j + 1u) {
        let lo = net_u32_at(O_PTHR + 3u * j);
        let hi = net_u32_at(O_PTHR + 3u * j + 1u);
        if (m.y < hi || (m.y == hi && m.x < lo)) {
            return net_u32_at(O_PTHR + 3u * j + 2u);
        }
    }
    // Not reached: the last threshold is 2^53.
    return 0u;
}

// A float32 pair hi + lo.
struct Df {
    hi: f32,
    lo: f32,
}

// x through an XOR with a zero the compiler cannot see (`O_ZERO`): Mesa's NIR rewrites
// `(a + b) - a` to `b` for operations not marked exact, which WGSL cannot mark, and that
// would remove every error term below. Every rounded operation below passes through it, so
// that no compiler may reassociate or fuse them either (Metal compiles with fast math).
fn opaque(x: f32, zero: u32) -> f32 {
    return bitcast<f32>(bitcast<u32>(x) ^ zero);
}

// a + b exactly as hi + lo (Knuth).
fn two_sum(a: f32, b: f32, zero: u32) -> Df {
    let s = opaque(a + b, zero);
    let bb = opaque(s - a, zero);
    let ea = opaque(a - opaque(s - bb, zero), zero);
    let eb = opaque(b - bb, zero);
    return Df(s, opaque(ea + eb, zero));
}

// x as 12-bit halves (Dekker).
fn split(x: f32, zero: u32) -> Df {
    let t = opaque(4097.0 * x, zero);
    let hi = opaque(t - opaque(t - x, zero), zero);
    return Df(hi, opaque(x - hi, zero));
}

// a * b exactly as hi + lo (Dekker).
fn two_prod(a: f32, b: f32, zero: u32) -> Df {
    let p = opaque(a * b, zero);
    let x = split(a, zero);
    let y = split(b, zero);
    var e = opaque(opaque(x.hi * y.hi, zero) - p, zero);
    e = opaque(e + opaque(x.hi * y.lo, zero), zero);
    e = opaque(e + opaque(x.lo * y.hi, zero), zero);
    return Df(p, opaque(e + opaque(x.lo * y.lo, zero), zero));
}

// After-spike current a of group g after a spike, from its decayed value `ad`: `amp + ad *
// refr_decay` with the float64 constants as float32 pairs (`gd` and the rest at `O_GDLO`),
// in double-float32, rounded once to float32.
fn asc_jump(g: u32, a: u32, ad: f32) -> f32 {
    let zero = net_u32_at(O_ZERO);
    let ka = 1u + 2u * a;
    let kd = 2u + 2u * a;
    let amp = Df(gd(g, ka), net_wide[O_GDLO + g * GD + ka]);
    let dec = Df(gd(g, kd), net_wide[O_GDLO + g * GD + kd]);
    let p = two_prod(ad, dec.hi, zero);
    let s = two_sum(amp.hi, p.hi, zero);
    var tail = opaque(opaque(ad * dec.lo, zero) + amp.lo, zero);
    tail = opaque(p.lo + tail, zero);
    tail = opaque(s.lo + tail, zero);
    return s.hi + tail;
}
