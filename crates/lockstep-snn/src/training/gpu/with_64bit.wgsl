// The Poisson draws and the after-spike currents' jump with 64-bit types (SHADER_INT64,
// SHADER_F64): appended after the header (`alias wide = f64;`), before `bptt.wgsl`.
// `without_64bit.wgsl` gives the same functions in 32-bit types.

// The global sample of lane l: the batch's first (written per call at O_S0) plus l.
fn sample_of(l: u32) -> u64 {
    return ((u64(net_u32_at(O_S0 + 1u)) << 32u) | u64(net_u32_at(O_S0))) + u64(l);
}

fn splitmix64(x: u64) -> u64 {
    var z = x + 0x9E3779B97F4A7C15lu;
    z = (z ^ (z >> 30u)) * 0xBF58476D1CE4E5B9lu;
    z = (z ^ (z >> 27u)) * 0x94D049BB133111EBlu;
    return z ^ (z >> 31u);
}

// `input::keyed_uniform`: uniform in [0, 1) keyed by (seed, sample, node, step).
fn keyed_uniform(seed: u64, sample: u64, node: u64, t: u64) -> f64 {
    var x = splitmix64(seed ^ 0x005EED0F1A57lu);
    x = splitmix64(x ^ sample);
    x = splitmix64(x ^ (node * 0x9E3779B9lu));
    x = splitmix64(x ^ t);
    return f64(x >> 11u) * (1.0lf / 9007199254740992.0lf);
}

// The Poisson count of Poisson node p (virtual node v) in sample l at step t: the CPU's
// inversion (`Inputs::poisson_events`) in float64.
fn poisson_count(p: u32, v: u32, l: u32, t: u32) -> u32 {
    let seed = (u64(net_u32_at(O_SEED + 1u)) << 32u) | u64(net_u32_at(O_SEED));
    let u = keyed_uniform(seed, sample_of(l), u64(v), u64(t));
    let mean = net_wide[O_PMEAN + p];
    var pr = net_wide[O_PP0 + p];
    var cdf = pr;
    var k = 0u;
    loop {
        if (!(u >= cdf && k < 10000u)) {
            break;
        }
        k = k + 1u;
        pr = pr * (mean / f64(k));
        cdf = cdf + pr;
        if (pr == 0.0lf) {
            break;
        }
    }
    return k;
}

// After-spike current a of group g after a spike, from its decayed value `ad`:
// `amp + ad * refr_decay` in float64 rounded to float32, as the CPU engines compute it.
fn asc_jump(g: u32, a: u32, ad: f32) -> f32 {
    return f32(gd(g, 1u + 2u * a) + f64(ad) * gd(g, 2u + 2u * a));
}
