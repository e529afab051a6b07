//! Layer kernels for burn's CubeCL backends (wgpu, CUDA), float32: LayerNorm with its
//! affine map and an optional ELU after it, a bias with an optional ELU after a matrix
//! product, and the tail of a context-gated residual block, each one launch forward and
//! one launch backward (the backward launch includes the column sums that give the bias
//! and scale gradients). burn's composed operations launch 11 kernels for a LayerNorm's
//! forward pass and about 33 for its backward pass, and 8 for a gated block's tail
//! (the context's product, two bias additions, the sigmoid, the product, the residual
//! addition) forward.
//!
//! Each backward kernel runs two kinds of thread in one launch: the first threads compute
//! the per-row (or per-element) input gradients; the `cols` threads after them compute one
//! column's sum over the rows (bias and scale gradients), recomputing what they need from
//! the forward pass's inputs and saved values, so no thread waits for another.
//!
//! - LayerNorm (PyTorch `nn.LayerNorm` over the last dimension, biased variance):
//!   `x̂ = (x - μ) r`, `r = 1 / sqrt(σ² + eps)`, `z = x̂ w + b`, `y = elu(z)` or `z`; the
//!   forward kernel saves `(μ, r)` per row. Backward, with `g' = g elu'(z)` (from `y`:
//!   1 where `y > 0`, else `y + 1`) and `d = g' w`: `dx = r (d - mean(d) - x̂ mean(d x̂))`,
//!   `dw = Σ_rows g' x̂`, `db = Σ_rows g'`. Rows of equal values have `σ² = 0`, `x̂ = 0`.
//! - bias and ELU: `y = elu(a + b)` (`a` the product `x Wᵀ`); backward `da = g elu'`,
//!   `db = Σ_rows da`.
//! - gated residual tail (nflows' `ResidualBlock` with a context layer): from the product
//!   `a = t W₁ᵀ` and the context (its product `c = context W_cᵀ` summed in the kernel: `k`
//!   terms per entry, 64 for Dingo's context, where burn's matrix product was a launch
//!   forward and two backward per gate), `y = x + (a + b₁) s`, `s = sigmoid(c + b_c)` (kept
//!   for the backward kernel); backward `da = g s`, `dc = g (a + b₁) s (1 - s)`,
//!   `dcontext = dc W_c`, `dW_c = dcᵀ context`, `db₁ = Σ_rows da`, `db_c = Σ_rows dc` (and
//!   `dx = g`, no kernel), all in one launch.
//!
//! - a residual block's end `y = x + (a + b)` (the embedding's blocks, without a context):
//!   one launch for the composed form's two additions.
//!
//! One thread per row does a LayerNorm row's two passes (mean, then variance) in the order
//! burn's `var_mean_bias` sums. Row-major contiguous tensors (made so first).

use crate::activation_kernel::elu_value;
use burn::tensor::{f16, DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;
use cubecl::{calculate_cube_count_elemwise, CubeDim};

/// ELU's slope at the point whose ELU is `y`: 1 where `y > 0`, else `y + 1`.
#[cube]
fn elu_slope(y: f32) -> f32 {
    let mut d = y + 1.0;
    if y > 0.0 {
        d = 1.0;
    }
    d
}

/// LayerNorm (and ELU when `elu == 1`) of each row of `x: [rows, cols]`; `stats[2 r]` and
/// `stats[2 r + 1]` get row `r`'s mean and `1 / sqrt(var + eps)`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn layer_norm_forward(
    x: &Array<f32>,
    w: &Array<f32>,
    b: &Array<f32>,
    y: &mut Array<f32>,
    stats: &mut Array<f32>,
    rows: u32,
    cols: u32,
    eps: f32,
    elu: u32,
) {
    let r = ABSOLUTE_POS as u32;
    if r >= rows {
        terminate!();
    }
    let base = r * cols;
    let count = f32::cast_from(cols);
    let mut sum = 0.0f32;
    for j in 0..cols {
        sum += x[(base + j) as usize];
    }
    let mean = sum / count;
    let mut squares = 0.0f32;
    for j in 0..cols {
        let d = x[(base + j) as usize] - mean;
        squares += d * d;
    }
    let rstd = 1.0 / f32::sqrt(squares / count + eps);
    for j in 0..cols {
        let z = (x[(base + j) as usize] - mean) * rstd * w[j as usize] + b[j as usize];
        let mut out = z;
        if elu == 1 {
            out = elu_value::<f32>(z);
        }
        y[(base + j) as usize] = out;
    }
    stats[(2 * r) as usize] = mean;
    stats[(2 * r + 1) as usize] = rstd;
}

/// The gradient of [`layer_norm_forward`]: threads `0..rows` write `dx` of their row,
/// threads `rows..rows + cols` the column's `dw` and `db`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn layer_norm_backward(
    x: &Array<f32>,
    w: &Array<f32>,
    y: &Array<f32>,
    stats: &Array<f32>,
    g: &Array<f32>,
    dx: &mut Array<f32>,
    dw: &mut Array<f32>,
    db: &mut Array<f32>,
    rows: u32,
    cols: u32,
    elu: u32,
) {
    let t = ABSOLUTE_POS as u32;
    if t >= rows + cols {
        terminate!();
    }
    if t < rows {
        let base = t * cols;
        let mean = stats[(2 * t) as usize];
        let rstd = stats[(2 * t + 1) as usize];
        let mut sum_d = 0.0f32;
        let mut sum_dx = 0.0f32;
        for j in 0..cols {
            let i = (base + j) as usize;
            let mut gp = g[i];
            if elu == 1 {
                gp *= elu_slope(y[i]);
            }
            let d = gp * w[j as usize];
            let xhat = (x[i] - mean) * rstd;
            sum_d += d;
            sum_dx += d * xhat;
        }
        let inv = 1.0 / f32::cast_from(cols);
        let mean_d = sum_d * inv;
        let mean_dx = sum_dx * inv;
        for j in 0..cols {
            let i = (base + j) as usize;
            let mut gp = g[i];
            if elu == 1 {
                gp *= elu_slope(y[i]);
            }
            let d = gp * w[j as usize];
            let xhat = (x[i] - mean) * rstd;
            dx[i] = rstd * (d - mean_d - xhat * mean_dx);
        }
    } else {
        let j = t - rows;
        let mut sw = 0.0f32;
        let mut sb = 0.0f32;
        for r in 0..rows {
            let i = (r * cols + j) as usize;
            let mut gp = g[i];
            if elu == 1 {
                gp *= elu_slope(y[i]);
            }
            let xhat = (x[i] - stats[(2 * r) as usize]) * stats[(2 * r + 1) as usize];
            sw += gp * xhat;
            sb += gp;
        }
        dw[j as usize] = sw;
        db[j as usize] = sb;
    }
}

/// `y = elu(a + b)` (`elu == 1`) or `a + b`, `a: [rows, cols]`, `b: [cols]`.
#[cube(launch)]
fn bias_forward(a: &Array<f32>, b: &Array<f32>, y: &mut Array<f32>, n: u32, cols: u32, elu: u32) {
    let i = ABSOLUTE_POS as u32;
    if i >= n {
        terminate!();
    }
    let z = a[i as usize] + b[(i % cols) as usize];
    let mut out = z;
    if elu == 1 {
        out = elu_value::<f32>(z);
    }
    y[i as usize] = out;
}

/// The gradient of [`bias_forward`] from its output `y`: threads `0..n` write `da`,
/// threads `n..n + cols` the column sums `db`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn bias_backward(
    y: &Array<f32>,
    g: &Array<f32>,
    da: &mut Array<f32>,
    db: &mut Array<f32>,
    n: u32,
    cols: u32,
    elu: u32,
) {
    let t = ABSOLUTE_POS as u32;
    if t >= n + cols {
        terminate!();
    }
    if t < n {
        let mut gp = g[t as usize];
        if elu == 1 {
            gp *= elu_slope(y[t as usize]);
        }
        da[t as usize] = gp;
    } else {
        let j = t - n;
        let rows = n / cols;
        let mut s = 0.0f32;
        for r in 0..rows {
            let i = (r * cols + j) as usize;
            let mut gp = g[i];
            if elu == 1 {
                gp *= elu_slope(y[i]);
            }
            s += gp;
        }
        db[j as usize] = s;
    }
}

/// `y = x + a + b` (`x`, `a`: `[rows, cols]`, `b: [cols]`): a residual block's end.
#[cube(launch)]
fn residual_forward(
    x: &Array<f32>,
    a: &Array<f32>,
    b: &Array<f32>,
    y: &mut Array<f32>,
    n: u32,
    cols: u32,
) {
    let i = ABSOLUTE_POS as u32;
    if i >= n {
        terminate!();
    }
    y[i as usize] = x[i as usize] + (a[i as usize] + b[(i % cols) as usize]);
}

/// `y = x + (a + b1) s`, `s = sigmoid(context wcᵀ + bc)` (`x`, `a`, `y`, `s`:
/// `[rows, cols]`; `context: [rows, k]`, `wc: [cols, k]`, `b1`, `bc: [cols]`), the
/// context's product summed here (`k` terms per entry); `s` is kept for the backward kernel.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn gated_forward<A: Float>(
    x: &Array<f32>,
    a: &Array<A>,
    b1: &Array<f32>,
    context: &Array<f32>,
    wc: &Array<f32>,
    bc: &Array<f32>,
    y: &mut Array<f32>,
    s: &mut Array<f32>,
    n: u32,
    cols: u32,
    k: u32,
) {
    let i = ABSOLUTE_POS as u32;
    if i >= n {
        terminate!();
    }
    let r = i / cols;
    let o = i % cols;
    let mut c = 0.0f32;
    for q in 0..k {
        c += context[(r * k + q) as usize] * wc[(o * k + q) as usize];
    }
    let gate = 1.0 / (f32::exp(-(c + bc[o as usize])) + 1.0);
    s[i as usize] = gate;
    y[i as usize] = x[i as usize] + (f32::cast_from(a[i as usize]) + b1[o as usize]) * gate;
}

/// The gradient of the gate's argument at entry `i` (column `o`): `g (a + b1) s (1 - s)`.
#[cube]
fn gate_gradient<A: Float>(
    a: &Array<A>,
    b1: &Array<f32>,
    s: &Array<f32>,
    g: &Array<f32>,
    i: u32,
    o: u32,
) -> f32 {
    let si = s[i as usize];
    g[i as usize] * (f32::cast_from(a[i as usize]) + b1[o as usize]) * si * (1.0 - si)
}

/// The gradient of [`gated_forward`]: threads `0..n` write `da = g s` (in `a`'s type: a
/// float16 product's gradient is float16, as its backward step reads it), the next `rows k`
/// one entry of `dcontext = dc wc` each, the next `cols k` one entry of `dwc = dcᵀ context`
/// each, the last `cols` one column's `db1 = Σ_rows da` and `dbc = Σ_rows dc` each, with
/// `dc = g (a + b1) s (1 - s)` recomputed where needed (so no thread waits for another).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn gated_backward<A: Float>(
    a: &Array<A>,
    b1: &Array<f32>,
    s: &Array<f32>,
    context: &Array<f32>,
    wc: &Array<f32>,
    g: &Array<f32>,
    da: &mut Array<A>,
    dcontext: &mut Array<f32>,
    dwc: &mut Array<f32>,
    db1: &mut Array<f32>,
    dbc: &mut Array<f32>,
    n: u32,
    cols: u32,
    k: u32,
) {
    let t = ABSOLUTE_POS as u32;
    let rows = n / cols;
    let (e1, e2) = (n + rows * k, n + rows * k + cols * k);
    if t >= e2 + cols {
        terminate!();
    }
    if t < n {
        da[t as usize] = A::cast_from(g[t as usize] * s[t as usize]);
    } else if t < e1 {
        let m = t - n;
        let r = m / k;
        let q = m % k;
        let mut v = 0.0f32;
        for o in 0..cols {
            v += gate_gradient(a, b1, s, g, r * cols + o, o) * wc[(o * k + q) as usize];
        }
        dcontext[m as usize] = v;
    } else if t < e2 {
        let m = t - e1;
        let o = m / k;
        let q = m % k;
        let mut v = 0.0f32;
        for r in 0..rows {
            v += gate_gradient(a, b1, s, g, r * cols + o, o) * context[(r * k + q) as usize];
        }
        dwc[m as usize] = v;
    } else {
        let o = t - e2;
        let mut s1 = 0.0f32;
        let mut sc = 0.0f32;
        for r in 0..rows {
            let i = r * cols + o;
            s1 += g[i as usize] * s[i as usize];
            sc += gate_gradient(a, b1, s, g, i, o);
        }
        db1[o as usize] = s1;
        dbc[o as usize] = sc;
    }
}

/// The launch grid for `threads` threads.
fn grid<R: CubeRuntime>(t: &CubeTensor<R>, threads: usize) -> (CubeCount, CubeDim) {
    let client = &t.client;
    let dim = CubeDim::new(client, threads.max(1));
    (
        calculate_cube_count_elemwise(client, threads.max(1), dim),
        dim,
    )
}

/// `(rows, cols)` of a 2-D float32 tensor, as the kernels' `u32`s.
///
/// Panics on another rank or dtype, or more than 2^32 values.
fn dims<R: CubeRuntime>(t: &CubeTensor<R>, what: &str) -> (u32, u32) {
    assert_eq!(t.dtype, DType::F32, "layer kernel: {what} is not float32");
    let shape = t.shape();
    assert_eq!(shape.num_dims(), 2, "layer kernel: {what} is not a matrix");
    // The backward kernels run one thread per value and one per column.
    let threads = shape.num_elements() + shape[1];
    assert!(
        u32::try_from(threads).is_ok(),
        "layer kernel: fewer than 2^32 values"
    );
    (shape[0] as u32, shape[1] as u32)
}

/// `(rows, cols)` of a block's product, float32 or float16 (mixed precision's).
fn product_dims<R: CubeRuntime>(a: &CubeTensor<R>) -> (u32, u32) {
    assert!(
        matches!(a.dtype, DType::F32 | DType::F16),
        "layer kernel: the block's product is neither float32 nor float16"
    );
    let shape = a.shape();
    assert_eq!(
        shape.num_dims(),
        2,
        "layer kernel: the block's product is not a matrix"
    );
    (shape[0] as u32, shape[1] as u32)
}

/// A new float32 tensor of `shape` on `like`'s device.
fn empty<R: CubeRuntime>(like: &CubeTensor<R>, shape: Shape) -> CubeTensor<R> {
    empty_device::<R, f32>(like.client.clone(), like.device.clone(), shape)
}

/// Asserts that `v` is a float32 vector of `len` values.
fn check_vector<R: CubeRuntime>(v: &CubeTensor<R>, len: u32, what: &str) {
    assert_eq!(v.dtype, DType::F32, "layer kernel: {what} is not float32");
    assert_eq!(
        v.shape().num_elements(),
        len as usize,
        "layer kernel: {what} has the wrong length"
    );
}

/// LayerNorm of the rows of `x: [rows, cols]` with scale `w` and shift `b` (`[cols]`),
/// followed by ELU when `elu`: `(y [rows, cols], stats [rows, 2])` (each row's mean and
/// `1 / sqrt(var + eps)`, for [`layer_norm_backward_launch`]). One launch.
///
/// Panics on shapes that do not fit or a dtype other than float32.
pub fn layer_norm_forward_launch<R: CubeRuntime>(
    x: CubeTensor<R>,
    w: CubeTensor<R>,
    b: CubeTensor<R>,
    eps: f64,
    elu: bool,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (rows, cols) = dims(&x, "x");
    check_vector(&w, cols, "the scale");
    check_vector(&b, cols, "the shift");
    let (x, w, b) = (into_contiguous(x), into_contiguous(w), into_contiguous(b));
    let y = empty(&x, x.shape());
    let stats = empty(&x, Shape::new([rows as usize, 2]));
    let (count, dim) = grid(&x, rows as usize);
    layer_norm_forward::launch::<R>(
        &x.client.clone(),
        count,
        dim,
        x.into_array_arg(),
        w.into_array_arg(),
        b.into_array_arg(),
        y.clone().into_array_arg(),
        stats.clone().into_array_arg(),
        rows,
        cols,
        eps as f32,
        u32::from(elu),
    );
    (y, stats)
}

/// The gradients `(dx [rows, cols], dw [cols], db [cols])` of
/// [`layer_norm_forward_launch`] from its input `x`, scale `w`, output `y`, `stats` and the
/// incoming gradient `g` (same shape as `x`). One launch.
///
/// Panics on shapes that do not fit or a dtype other than float32.
pub fn layer_norm_backward_launch<R: CubeRuntime>(
    x: CubeTensor<R>,
    w: CubeTensor<R>,
    y: CubeTensor<R>,
    stats: CubeTensor<R>,
    g: CubeTensor<R>,
    elu: bool,
) -> (CubeTensor<R>, CubeTensor<R>, CubeTensor<R>) {
    let (rows, cols) = dims(&x, "x");
    check_vector(&w, cols, "the scale");
    assert_eq!(dims(&y, "y"), (rows, cols), "layer kernel: y's shape");
    assert_eq!(
        dims(&g, "the gradient"),
        (rows, cols),
        "layer kernel: g's shape"
    );
    check_vector(&stats, 2 * rows, "the statistics");
    let (x, w, y, stats, g) = (
        into_contiguous(x),
        into_contiguous(w),
        into_contiguous(y),
        into_contiguous(stats),
        into_contiguous(g),
    );
    let dx = empty(&x, x.shape());
    let dw = empty(&x, Shape::new([cols as usize]));
    let db = empty(&x, Shape::new([cols as usize]));
    let (count, dim) = grid(&x, (rows + cols) as usize);
    layer_norm_backward::launch::<R>(
        &x.client.clone(),
        count,
        dim,
        x.into_array_arg(),
        w.into_array_arg(),
        y.into_array_arg(),
        stats.into_array_arg(),
        g.into_array_arg(),
        dx.clone().into_array_arg(),
        dw.clone().into_array_arg(),
        db.clone().into_array_arg(),
        rows,
        cols,
        u32::from(elu),
    );
    (dx, dw, db)
}

/// `a + b` (`a: [rows, cols]`, `b: [cols]` broadcast over the rows), followed by ELU when
/// `elu`. One launch.
///
/// Panics on shapes that do not fit or a dtype other than float32.
pub fn bias_forward_launch<R: CubeRuntime>(
    a: CubeTensor<R>,
    b: CubeTensor<R>,
    elu: bool,
) -> CubeTensor<R> {
    let (rows, cols) = dims(&a, "the product");
    check_vector(&b, cols, "the bias");
    let (a, b) = (into_contiguous(a), into_contiguous(b));
    let y = empty(&a, a.shape());
    let n = rows * cols;
    let (count, dim) = grid(&a, n as usize);
    bias_forward::launch::<R>(
        &a.client.clone(),
        count,
        dim,
        a.into_array_arg(),
        b.into_array_arg(),
        y.clone().into_array_arg(),
        n,
        cols,
        u32::from(elu),
    );
    y
}

/// The gradients `(da [rows, cols], db [cols])` of [`bias_forward_launch`] from its output
/// `y` and the incoming gradient `g`. One launch.
///
/// Panics on shapes that differ or a dtype other than float32.
pub fn bias_backward_launch<R: CubeRuntime>(
    y: CubeTensor<R>,
    g: CubeTensor<R>,
    elu: bool,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (rows, cols) = dims(&y, "y");
    assert_eq!(
        dims(&g, "the gradient"),
        (rows, cols),
        "layer kernel: g's shape"
    );
    let (y, g) = (into_contiguous(y), into_contiguous(g));
    let da = empty(&y, y.shape());
    let db = empty(&y, Shape::new([cols as usize]));
    let n = rows * cols;
    let (count, dim) = grid(&y, (n + cols) as usize);
    bias_backward::launch::<R>(
        &y.client.clone(),
        count,
        dim,
        y.into_array_arg(),
        g.into_array_arg(),
        da.clone().into_array_arg(),
        db.clone().into_array_arg(),
        n,
        cols,
        u32::from(elu),
    );
    (da, db)
}

/// A residual block's end `x + (a + b)` (`x`, `a`: `[rows, cols]`, `b: [cols]`; the
/// addition in the composed form's order). One launch, where the composed form launched
/// two additions; the backward pass needs no kernel of its own (`dx = da = g`,
/// `db = Σ_rows g`).
///
/// Panics on shapes that do not fit or a dtype other than float32.
pub fn residual_forward_launch<R: CubeRuntime>(
    x: CubeTensor<R>,
    a: CubeTensor<R>,
    b: CubeTensor<R>,
) -> CubeTensor<R> {
    let (rows, cols) = dims(&x, "x");
    assert_eq!(dims(&a, "a"), (rows, cols), "layer kernel: a's shape");
    check_vector(&b, cols, "the bias");
    let [x, a, b] = [x, a, b].map(into_contiguous);
    let y = empty(&x, x.shape());
    let n = rows * cols;
    let (count, dim) = grid(&x, n as usize);
    residual_forward::launch::<R>(
        &x.client.clone(),
        count,
        dim,
        x.into_array_arg(),
        a.into_array_arg(),
        b.into_array_arg(),
        y.clone().into_array_arg(),
        n,
        cols,
    );
    y
}

/// The gated residual tail `(y, s)`: `y = x + (a + b1) s`, `s = sigmoid(context wcᵀ + bc)`
/// (`x`, `a`: `[rows, cols]`; `context: [rows, k]`; `wc` flat `[cols k]`; `b1`, `bc`:
/// `[cols]`), the context's product inside the kernel. One launch.
///
/// Panics on shapes that do not fit or a dtype other than float32.
pub fn gated_forward_launch<R: CubeRuntime>(
    x: CubeTensor<R>,
    a: CubeTensor<R>,
    b1: CubeTensor<R>,
    context: CubeTensor<R>,
    wc: CubeTensor<R>,
    bc: CubeTensor<R>,
) -> (CubeTensor<R>, CubeTensor<R>) {
    let (rows, cols) = dims(&x, "x");
    assert_eq!(product_dims(&a), (rows, cols), "layer kernel: a's shape");
    let (crows, k) = dims(&context, "the context");
    assert_eq!(crows, rows, "layer kernel: the context's rows");
    check_vector(&wc, cols * k, "the context layer's weight");
    check_vector(&b1, cols, "the block's bias");
    check_vector(&bc, cols, "the context layer's bias");
    let [x, a, b1, context, wc, bc] = [x, a, b1, context, wc, bc].map(into_contiguous);
    let y = empty(&x, x.shape());
    let s = empty(&x, x.shape());
    let n = rows * cols;
    let (count, dim) = grid(&x, n as usize);
    let launch = match a.dtype {
        DType::F16 => gated_forward::launch::<f16, R>,
        _ => gated_forward::launch::<f32, R>,
    };
    launch(
        &x.client.clone(),
        count,
        dim,
        x.into_array_arg(),
        a.into_array_arg(),
        b1.into_array_arg(),
        context.into_array_arg(),
        wc.into_array_arg(),
        bc.into_array_arg(),
        y.clone().into_array_arg(),
        s.clone().into_array_arg(),
        n,
        cols,
        k,
    );
    (y, s)
}

/// The gradients `[da [rows, cols], dcontext [rows, k], dwc [cols k], db1, dbc [cols]]` of
/// [`gated_forward_launch`] (with its `s`) for the incoming gradient `g` (that of `x` is
/// `g` itself); `da` in `a`'s dtype (float16 for mixed precision's float16 product, the
/// rest float32). One launch.
///
/// Panics on shapes that do not fit or other dtypes.
pub fn gated_backward_launch<R: CubeRuntime>(
    a: CubeTensor<R>,
    b1: CubeTensor<R>,
    s: CubeTensor<R>,
    context: CubeTensor<R>,
    wc: CubeTensor<R>,
    g: CubeTensor<R>,
) -> [CubeTensor<R>; 5] {
    let (rows, cols) = product_dims(&a);
    assert_eq!(dims(&s, "s"), (rows, cols), "layer kernel: s's shape");
    assert_eq!(
        dims(&g, "the gradient"),
        (rows, cols),
        "layer kernel: g's shape"
    );
    let (crows, k) = dims(&context, "the context");
    assert_eq!(crows, rows, "layer kernel: the context's rows");
    check_vector(&wc, cols * k, "the context layer's weight");
    check_vector(&b1, cols, "the block's bias");
    let [a, b1, s, context, wc, g] = [a, b1, s, context, wc, g].map(into_contiguous);
    let da = match a.dtype {
        DType::F16 => empty_device::<R, f16>(s.client.clone(), s.device.clone(), s.shape()),
        _ => empty(&s, s.shape()),
    };
    let dcontext = empty(&s, context.shape());
    let dwc = empty(&s, Shape::new([(cols * k) as usize]));
    let db1 = empty(&s, Shape::new([cols as usize]));
    let dbc = empty(&s, Shape::new([cols as usize]));
    let n = rows * cols;
    let threads = n + rows * k + cols * k + cols;
    let (count, dim) = grid(&s, threads as usize);
    let launch = match a.dtype {
        DType::F16 => gated_backward::launch::<f16, R>,
        _ => gated_backward::launch::<f32, R>,
    };
    launch(
        &s.client.clone(),
        count,
        dim,
        a.into_array_arg(),
        b1.into_array_arg(),
        s.into_array_arg(),
        context.into_array_arg(),
        wc.into_array_arg(),
        g.into_array_arg(),
        da.clone().into_array_arg(),
        dcontext.clone().into_array_arg(),
        dwc.clone().into_array_arg(),
        db1.clone().into_array_arg(),
        dbc.clone().into_array_arg(),
        n,
        cols,
        k,
    );
    [da, dcontext, dwc, db1, dbc]
}
