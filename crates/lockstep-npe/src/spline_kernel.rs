//! The rational-quadratic spline coupling ([`crate::spline::rational_quadratic_spline`],
//! forward direction) as two GPU kernels for burn's CubeCL backends (wgpu, CUDA): one
//! launch for the forward pass and one for its backward pass, where the composed burn
//! operations launch about 90 kernels forward and 150 backward per coupling step (softmax,
//! cumulative sums, concatenations, the bin search, seven gathers, the formulas, masks).
//!
//! One thread per transformed scalar (row `m` of `M` = batch x transformed features), `K`
//! bins. Inputs: `x: [M]` and the conditioner's raw output `raw: [M, 3K-1]` (row-major;
//! unnormalized widths `raw[.., 0..K] * scale`, heights `raw[.., K..2K] * scale`, interior
//! derivatives `raw[.., 2K..3K-1]`, as the coupling slices them). The forward kernel writes
//! `[M, 2]`: `y` and `log|dy/dx|`. The backward kernel takes the gradient `[M, 2]` of both
//! and writes `dx: [M]` and `draw: [M, 3K-1]`, recomputing the forward pass per row.
//!
//! In a training pass the inputs come straight from the flow state `[N, n + 2]`
//! (`crate::coupling_kernel`): row `m = r t + j` reads column `start + 2j` of state row `r`,
//! and the backward kernel writes the state's gradient `[N, n + 2]`, zeros in the columns
//! the spline does not read (each written by one thread: column `q` by thread `j = q mod
//! t` of its row), so no gather or scatter of the transformed features is launched.
//!
//! The arithmetic is that of the composed version, in the same order (softmax as
//! `exp(u - max) / Σ`, knots as `cumsum(sizes) * 2B - B` with the end knots exactly at
//! `±B`, the bin as the count of knots at or below `x`), except softplus, computed as
//! `max(u, 0) + ln(1 + exp(-|u|))` (burn's `ln(exp(u) + 1)` overflows for `u > 88`). The
//! backward pass is the reverse-mode derivative of that program, written out step by step
//! in `spline_backward` (the adjoint of each assignment, last first); the tests compare
//! both kernels with burn's autodiff of the composed version.

use crate::spline::SplineParams;
use burn::tensor::{Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;
use cubecl::{calculate_cube_count_elemwise, CubeDim};

/// The knot `j` (`0..=K`) of a row's cumulative bin sizes: `-B` for `j = 0`, `B` for
/// `j = K`, else `S_j * 2B - B` with `S_j` the sum of the first `j` sizes.
#[cube]
fn knot(sum: f32, j: u32, k: u32, bound: f32) -> f32 {
    let mut v = sum * (2.0 * bound) - bound;
    if j == 0 {
        v = -bound;
    }
    if j == k {
        v = bound;
    }
    v
}

/// `ln(1 + e^u)`, overflow-free.
#[cube]
fn softplus(u: f32) -> f32 {
    f32::max(u, 0.0) + f32::ln(1.0 + f32::exp(-f32::abs(u)))
}

/// Where `x` falls in a row's spline and what the formulas need of it: the bin, its knots
/// in x and y, the knot derivatives at its ends, and the two softmaxes' maxima and sums
/// (for the backward pass).
#[derive(CubeType)]
struct Located {
    bin: u32,
    lo: f32,
    hi: f32,
    hlo: f32,
    hhi: f32,
    dk: f32,
    dk1: f32,
    mx: f32,
    total: f32,
    hmx: f32,
    htotal: f32,
}

/// Entry `i` of the raw row at `base`, plus entry `boff + i` of the final layer's bias when
/// `biased` (the conditioner's product arrives without its bias, which is added here).
#[cube]
fn rv(
    raw: &Array<f32>,
    bias: &Array<f32>,
    base: u32,
    i: u32,
    boff: u32,
    #[comptime] biased: bool,
) -> f32 {
    let mut v = raw[(base + i) as usize];
    if biased {
        v += bias[(boff + i) as usize];
    }
    v
}

/// [`Located`] for input `xm` (inside `[-B, B]`) and the row at `base` of `raw`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn locate(
    xm: f32,
    raw: &Array<f32>,
    bias: &Array<f32>,
    boff: u32,
    #[comptime] biased: bool,
    base: u32,
    k: u32,
    scale: f32,
    bound: f32,
    min_width: f32,
    min_height: f32,
    min_derivative: f32,
    boundary_derivative: f32,
) -> Located {
    // Widths: softmax over raw[base + i] * scale, floor, knots; the bin holding x.
    let mut mx = rv(raw, bias, base, 0, boff, biased) * scale;
    for i in 1..k {
        mx = f32::max(mx, rv(raw, bias, base, i, boff, biased) * scale);
    }
    let mut total = 0.0f32;
    for i in 0..k {
        total += f32::exp(rv(raw, bias, base, i, boff, biased) * scale - mx);
    }
    let spread = 1.0 - min_width * f32::cast_from(k);
    let mut sum = 0.0f32;
    let mut bin = 0u32;
    let mut lo = -bound;
    let mut hi = bound;
    for j in 0..k {
        let left = knot(sum, j, k, bound);
        let s = (f32::exp(rv(raw, bias, base, j, boff, biased) * scale - mx) / total) * spread
            + min_width;
        sum += s;
        let right = knot(sum, j + 1, k, bound);
        if xm >= left {
            bin = j;
            lo = left;
            hi = right;
        }
    }
    // Heights: the same up to the chosen bin's knots.
    let mut hmx = rv(raw, bias, base, k, boff, biased) * scale;
    for i in 1..k {
        hmx = f32::max(hmx, rv(raw, bias, base, k + i, boff, biased) * scale);
    }
    let mut htotal = 0.0f32;
    for i in 0..k {
        htotal += f32::exp(rv(raw, bias, base, k + i, boff, biased) * scale - hmx);
    }
    let hspread = 1.0 - min_height * f32::cast_from(k);
    let mut hsum = 0.0f32;
    let mut hlo = -bound;
    let mut hhi = bound;
    for j in 0..k {
        let left = knot(hsum, j, k, bound);
        let s = (f32::exp(rv(raw, bias, base, k + j, boff, biased) * scale - hmx) / htotal)
            * hspread
            + min_height;
        hsum += s;
        let right = knot(hsum, j + 1, k, bound);
        if j == bin {
            hlo = left;
            hhi = right;
        }
    }
    // Knot derivatives at the bin's ends (the outer ones fixed).
    let mut dk = boundary_derivative;
    if bin > 0 {
        dk = softplus(rv(raw, bias, base, 2 * k + bin - 1, boff, biased)) + min_derivative;
    }
    let mut dk1 = boundary_derivative;
    if bin + 1 < k {
        dk1 = softplus(rv(raw, bias, base, 2 * k + bin, boff, biased)) + min_derivative;
    }
    Located {
        bin,
        lo,
        hi,
        hlo,
        hhi,
        dk,
        dk1,
        mx,
        total,
        hmx,
        htotal,
    }
}

/// The rational-quadratic formula's intermediate values for input `xm` in the bin
/// [`Located`] describes (Durkan et al. 2019, eq. 4 and appendix A): bin width `wk` and
/// height `hk`, slope `delta`, `theta = t1 / wk` with `t1 = xm - lo`, `omt = 1 - theta`,
/// `tomt = theta omt`, `th2 = theta²`, the numerator `num = hk p` with
/// `p = delta th2 + dk tomt`, the denominator `den = delta + curv tomt` with
/// `curv = dk + dk1 - 2 delta`, and the derivative's numerator `dn = delta² sq` with
/// `sq = dk1 th2 + 2 delta tomt + dk omt²`; `y = hlo + num / den`,
/// `log|dy/dx| = ln dn - 2 ln den`.
#[derive(CubeType)]
struct Terms {
    wk: f32,
    hk: f32,
    delta: f32,
    curv: f32,
    t1: f32,
    theta: f32,
    omt: f32,
    tomt: f32,
    th2: f32,
    p: f32,
    num: f32,
    den: f32,
    sq: f32,
    dn: f32,
}

/// [`Terms`] of input `xm` in bin `r`.
#[cube]
fn rq_terms(xm: f32, r: &Located) -> Terms {
    let wk = r.hi - r.lo;
    let hk = r.hhi - r.hlo;
    let delta = hk / wk;
    let curv = r.dk + r.dk1 - delta * 2.0;
    let t1 = xm - r.lo;
    let theta = t1 / wk;
    let omt = 1.0 - theta;
    let tomt = theta * omt;
    let th2 = theta * theta;
    let p = delta * th2 + r.dk * tomt;
    let num = hk * p;
    let den = delta + curv * tomt;
    let sq = r.dk1 * th2 + (delta * 2.0) * tomt + r.dk * (omt * omt);
    let dn = (delta * delta) * sq;
    Terms {
        wk,
        hk,
        delta,
        curv,
        t1,
        theta,
        omt,
        tomt,
        th2,
        p,
        num,
        den,
        sq,
        dn,
    }
}

/// The gradient reaching the cumulative sum `S_j` of knot `j` from bin size `i`, summed over
/// the two knots of `bin` that are interior (`1..K-1`) and lie after `i`: `g_lo` for knot
/// `bin`, `g_hi` for knot `bin + 1` (the end knots are constants).
#[cube]
fn size_grad(i: u32, bin: u32, k: u32, g_lo: f32, g_hi: f32) -> f32 {
    let mut g = 0.0f32;
    if bin > i && bin > 0 {
        g += g_lo;
    }
    if bin + 1 > i && bin + 1 < k {
        g += g_hi;
    }
    g
}

/// Where row `m`'s input sits: `x[(m / t) w + start + 2 (m mod t)]` (a flat `x: [M]` is
/// `t = w = 1`, `start = 0`).
#[cube]
fn input_at(m: u32, t: u32, w: u32, start: u32) -> u32 {
    (m / t) * w + start + 2 * (m % t)
}

/// The forward kernel: `out[2m] = y`, `out[2m + 1] = log|dy/dx|` for every row `m < rows`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn spline_forward(
    x: &Array<f32>,
    raw: &Array<f32>,
    bias: &Array<f32>,
    out: &mut Array<f32>,
    at_t: u32,
    at_w: u32,
    _at_n: u32,
    at_start: u32,
    rows: u32,
    k: u32,
    scale: f32,
    bound: f32,
    min_width: f32,
    min_height: f32,
    min_derivative: f32,
    boundary_derivative: f32,
    #[comptime] biased: bool,
) {
    let m = ABSOLUTE_POS as u32;
    let boff = (m % at_t) * (3 * k - 1);
    if m >= rows {
        terminate!();
    }
    let xm = x[input_at(m, at_t, at_w, at_start) as usize];
    let base = m * (3 * k - 1);
    // Outside [-B, B] (NaN included, as the composed mask): the identity.
    if !(xm >= -bound && xm <= bound) {
        out[(2 * m) as usize] = xm;
        out[(2 * m + 1) as usize] = 0.0;
    } else {
        let r = locate(
            xm,
            raw,
            bias,
            boff,
            biased,
            base,
            k,
            scale,
            bound,
            min_width,
            min_height,
            min_derivative,
            boundary_derivative,
        );
        let t = rq_terms(xm, &r);
        let y = r.hlo + t.num / t.den;
        let ld = f32::ln(t.dn) - f32::ln(t.den) * 2.0;
        out[(2 * m) as usize] = y;
        out[(2 * m + 1) as usize] = ld;
    }
}

/// The backward kernel: from `grad[2m]` (of `y`) and `grad[2m + 1]` (of `log|dy/dx|`),
/// `dx[m]` and the row `draw[m, 0..3K-1]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn spline_backward(
    x: &Array<f32>,
    raw: &Array<f32>,
    bias: &Array<f32>,
    grad: &Array<f32>,
    dx: &mut Array<f32>,
    draw: &mut Array<f32>,
    at_t: u32,
    at_w: u32,
    at_n: u32,
    at_start: u32,
    rows: u32,
    k: u32,
    scale: f32,
    bound: f32,
    min_width: f32,
    min_height: f32,
    min_derivative: f32,
    boundary_derivative: f32,
    #[comptime] biased: bool,
) {
    let m = ABSOLUTE_POS as u32;
    let boff = (m % at_t) * (3 * k - 1);
    if m >= rows {
        terminate!();
    }
    let xi = input_at(m, at_t, at_w, at_start);
    let xm = x[xi as usize];
    let base = m * (3 * k - 1);
    // The state's columns that no row reads: zeros, column q by thread q mod t of its row.
    let row = (m / at_t) * at_w;
    let j = m % at_t;
    for q in 0..at_w {
        let read = q < at_n && q >= at_start && ((q - at_start) & 1) == 0;
        if !read && q % at_t == j {
            dx[(row + q) as usize] = 0.0;
        }
    }
    let gy = grad[(2 * m) as usize];
    let gld = grad[(2 * m + 1) as usize];
    // Outside [-B, B] (NaN included, as the composed mask): the identity.
    if !(xm >= -bound && xm <= bound) {
        // Identity tails: dy/dx = 1, no parameter gradient.
        dx[xi as usize] = gy;
        for i in 0..3 * k - 1 {
            draw[(base + i) as usize] = 0.0;
        }
    } else {
        // The forward pass, as in `spline_forward`.
        let r = locate(
            xm,
            raw,
            bias,
            boff,
            biased,
            base,
            k,
            scale,
            bound,
            min_width,
            min_height,
            min_derivative,
            boundary_derivative,
        );
        let t = rq_terms(xm, &r);
        let spread = 1.0 - min_width * f32::cast_from(k);
        let hspread = 1.0 - min_height * f32::cast_from(k);
        let hb = base + k;
        let db = base + 2 * k;

        // Adjoints, last assignment first.
        // y = hlo + num / den; ld = ln(dn) - 2 ln(den)
        let g_hlo = gy;
        let g_num = gy / t.den;
        let g_den = -gy * t.num / (t.den * t.den) - gld * 2.0 / t.den;
        let g_dn = gld / t.dn;
        // dn = delta² sq; sq = dk1 th2 + 2 delta tomt + dk omt²
        let g_sq = g_dn * (t.delta * t.delta);
        let mut g_delta = g_dn * 2.0 * t.delta * t.sq + g_sq * 2.0 * t.tomt;
        let mut g_dk1 = g_sq * t.th2;
        let mut g_th2 = g_sq * r.dk1;
        let mut g_tomt = g_sq * 2.0 * t.delta;
        let mut g_dk = g_sq * (t.omt * t.omt);
        let mut g_omt = g_sq * r.dk * 2.0 * t.omt;
        // den = delta + curv tomt
        g_delta += g_den;
        let g_curv = g_den * t.tomt;
        g_tomt += g_den * t.curv;
        // curv = dk + dk1 - 2 delta
        g_dk += g_curv;
        g_dk1 += g_curv;
        g_delta -= g_curv * 2.0;
        // num = hk p; p = delta th2 + dk tomt
        let mut g_hk = g_num * t.p;
        let g_p = g_num * t.hk;
        g_delta += g_p * t.th2;
        g_th2 += g_p * t.delta;
        g_dk += g_p * t.tomt;
        g_tomt += g_p * r.dk;
        // th2 = theta²; tomt = theta omt; omt = 1 - theta
        let mut g_theta = g_th2 * 2.0 * t.theta + g_tomt * t.omt;
        g_omt += g_tomt * t.theta;
        g_theta -= g_omt;
        // delta = hk / wk; theta = t1 / wk; t1 = x - lo
        g_hk += g_delta / t.wk;
        let g_t1 = g_theta / t.wk;
        let g_wk = -(g_delta * t.hk) / (t.wk * t.wk) - (g_theta * t.t1) / (t.wk * t.wk);
        dx[xi as usize] = g_t1;
        let g_lo = -g_t1;
        // wk = hi - lo, hk = hhi - hlo: the knots at `bin` and `bin + 1`.
        let g_knot_lo = g_lo - g_wk;
        let g_knot_hi = g_wk;
        let g_hknot_lo = g_hlo - g_hk;
        let g_hknot_hi = g_hk;

        // Knot j (interior: 1..K-1) = S_j 2B - B with S_j = Σ_{i<j} size_i, so
        // d knot_j / d size_i = 2B for i < j; size_i = min + spread p_i; softmax:
        // du_i = p_i (dp_i - Σ_l p_l dp_l); u_i = raw_i scale.
        let mut dot = 0.0f32;
        let mut hdot = 0.0f32;
        for i in 0..k {
            let g_s = size_grad(i, r.bin, k, g_knot_lo, g_knot_hi);
            let hg_s = size_grad(i, r.bin, k, g_hknot_lo, g_hknot_hi);
            let pi = f32::exp(rv(raw, bias, base, i, boff, biased) * scale - r.mx) / r.total;
            let hpi = f32::exp(rv(raw, bias, base, k + i, boff, biased) * scale - r.hmx) / r.htotal;
            dot += pi * (g_s * (2.0 * bound) * spread);
            hdot += hpi * (hg_s * (2.0 * bound) * hspread);
        }
        for i in 0..k {
            let g_s = size_grad(i, r.bin, k, g_knot_lo, g_knot_hi);
            let hg_s = size_grad(i, r.bin, k, g_hknot_lo, g_hknot_hi);
            let pi = f32::exp(rv(raw, bias, base, i, boff, biased) * scale - r.mx) / r.total;
            let hpi = f32::exp(rv(raw, bias, base, k + i, boff, biased) * scale - r.hmx) / r.htotal;
            draw[(base + i) as usize] = pi * (g_s * (2.0 * bound) * spread - dot) * scale;
            draw[(hb + i) as usize] = hpi * (hg_s * (2.0 * bound) * hspread - hdot) * scale;
        }
        // Interior derivatives d_j = min + softplus(u_{j-1}), j = 1..K-1: d softplus = σ(u).
        for j in 1..k {
            let mut g = 0.0f32;
            if j == r.bin {
                g += g_dk;
            }
            if j == r.bin + 1 {
                g += g_dk1;
            }
            let u = rv(raw, bias, base, 2 * k + j - 1, boff, biased);
            draw[(db + j - 1) as usize] = g / (1.0 + f32::exp(-u));
        }
    }
}

/// The scalar parameters of both kernels.
struct Launch {
    /// The input layout `[t, w, n, start]` (see `input_at`).
    at: [u32; 4],
    /// `x`'s shape.
    x_shape: [usize; 2],
    rows: u32,
    k: u32,
    scale: f32,
    bound: f32,
    min_width: f32,
    min_height: f32,
    min_derivative: f32,
    boundary_derivative: f32,
}

/// Checks the shapes and the float32 dtype, and gathers the launch's scalars.
fn launch_params<R: CubeRuntime>(
    x: &CubeTensor<R>,
    raw: &CubeTensor<R>,
    scale: f64,
    sp: &SplineParams,
    state_start: Option<usize>,
) -> Launch {
    let k = sp.num_bins;
    let x_shape = x.shape().dims::<2>();
    let [m, width] = raw.shape().dims::<2>();
    let at = match state_start {
        None => [1, 1, 1, 0],
        Some(start) => {
            let w = x_shape[1];
            let t = crate::coupling_kernel::transformed_count(w, start);
            [t, w, w.saturating_sub(2), start]
        }
    };
    assert!(
        at[0] > 0 && x_shape[0] * at[0] == m && width == 3 * k - 1 && at[3] <= 1,
        "spline kernel: x {:?} and raw {:?} do not match K = {k} (state start {state_start:?})",
        x.shape(),
        raw.shape()
    );
    let at = at.map(|v| u32::try_from(v).expect("spline kernel: widths below 2^32"));
    assert!(
        x.dtype == burn::tensor::DType::F32 && raw.dtype == burn::tensor::DType::F32,
        "spline kernel: float32 tensors only ({:?}, {:?})",
        x.dtype,
        raw.dtype
    );
    // The boundary derivatives: softplus(c) + min_derivative = 1 (as the composed version
    // computes them, in float32).
    let c = ((1.0 - sp.min_derivative).exp() - 1.0).ln() as f32;
    let boundary = c.max(0.0) + (1.0 + (-c.abs()).exp()).ln() + sp.min_derivative as f32;
    Launch {
        at,
        x_shape,
        rows: u32::try_from(m).expect("spline kernel: fewer than 2^32 rows"),
        k: k as u32,
        scale: scale as f32,
        bound: sp.tail_bound as f32,
        min_width: sp.min_bin_width as f32,
        min_height: sp.min_bin_height as f32,
        min_derivative: sp.min_derivative as f32,
        boundary_derivative: boundary,
    }
}

/// Whether a bias is given, and the bias (contiguous, `[t (3K-1)]`, float32) or `raw` as a
/// placeholder that the kernels do not read.
fn checked_bias<R: CubeRuntime>(
    bias: Option<CubeTensor<R>>,
    raw: &CubeTensor<R>,
    p: &Launch,
) -> (bool, CubeTensor<R>) {
    match bias {
        Some(b) => {
            let len = p.at[0] as usize * (3 * p.k as usize - 1);
            assert!(
                b.dtype == burn::tensor::DType::F32 && b.shape().num_elements() == len,
                "spline kernel: the bias is not [t (3K-1)] = [{len}] float32"
            );
            (true, into_contiguous(b))
        }
        None => (false, raw.clone()),
    }
}

/// The forward spline of `x: [M, 1]` (or, with `state_start`, of the transformed columns of
/// the flow state `x: [N, n + 2]`, `M = N t`, see the module docs) with parameters
/// `raw: [M, 3K-1]` (widths and heights scaled by `scale`): `[M, 2]` holding `y` and
/// `log|dy/dx|` per row, in one launch. With `bias` (`[t (3K-1)]`, the conditioner's final
/// layer's) `raw` is that layer's product without it: row `m`'s parameters are
/// `raw[m] + bias[(m mod t) (3K-1)..]`, added in the kernel.
///
/// Panics on mismatched shapes or a dtype other than float32.
pub fn forward<R: CubeRuntime>(
    x: CubeTensor<R>,
    raw: CubeTensor<R>,
    scale: f64,
    sp: &SplineParams,
    state_start: Option<usize>,
    bias: Option<CubeTensor<R>>,
) -> CubeTensor<R> {
    let p = launch_params(&x, &raw, scale, sp, state_start);
    let (biased, bias) = checked_bias(bias, &raw, &p);
    let (x, raw) = (into_contiguous(x), into_contiguous(raw));
    let client = x.client.clone();
    let out = empty_device::<R, f32>(
        client.clone(),
        x.device.clone(),
        Shape::new([p.rows as usize, 2]),
    );
    let rows = p.rows as usize;
    let cube_dim = CubeDim::new(&client, rows);
    let cube_count = calculate_cube_count_elemwise(&client, rows, cube_dim);
    spline_forward::launch::<R>(
        &client,
        cube_count,
        cube_dim,
        x.into_array_arg(),
        raw.into_array_arg(),
        bias.into_array_arg(),
        out.clone().into_array_arg(),
        p.at[0],
        p.at[1],
        p.at[2],
        p.at[3],
        p.rows,
        p.k,
        p.scale,
        p.bound,
        p.min_width,
        p.min_height,
        p.min_derivative,
        p.boundary_derivative,
        biased,
    );
    out
}

/// The backward pass of [`forward`] (with the same `state_start` and `bias`; `draw` is also
/// the product's gradient, the bias's its column sums) for the incoming gradient
/// `grad: [M, 2]` (of `y` and of `log|dy/dx|`): `(dx, draw [M, 3K-1])`, `dx` of `x`'s shape,
/// in one launch.
///
/// Panics on mismatched shapes or a dtype other than float32.
pub fn backward<R: CubeRuntime>(
    x: CubeTensor<R>,
    raw: CubeTensor<R>,
    grad: CubeTensor<R>,
    scale: f64,
    sp: &SplineParams,
    state_start: Option<usize>,
    bias: Option<CubeTensor<R>>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let p = launch_params(&x, &raw, scale, sp, state_start);
    let (biased, bias) = checked_bias(bias, &raw, &p);
    let (x, raw, grad) = (
        into_contiguous(x),
        into_contiguous(raw),
        into_contiguous(grad),
    );
    let client = x.client.clone();
    let rows = p.rows as usize;
    let dx = empty_device::<R, f32>(client.clone(), x.device.clone(), Shape::new(p.x_shape));
    let draw = empty_device::<R, f32>(
        client.clone(),
        x.device.clone(),
        Shape::new([rows, 3 * sp.num_bins - 1]),
    );
    let cube_dim = CubeDim::new(&client, rows);
    let cube_count = calculate_cube_count_elemwise(&client, rows, cube_dim);
    spline_backward::launch::<R>(
        &client,
        cube_count,
        cube_dim,
        x.into_array_arg(),
        raw.into_array_arg(),
        bias.into_array_arg(),
        grad.into_array_arg(),
        dx.clone().into_array_arg(),
        draw.clone().into_array_arg(),
        p.at[0],
        p.at[1],
        p.at[2],
        p.at[3],
        p.rows,
        p.k,
        p.scale,
        p.bound,
        p.min_width,
        p.min_height,
        p.min_derivative,
        p.boundary_derivative,
        biased,
    );
    (dx, draw)
}
