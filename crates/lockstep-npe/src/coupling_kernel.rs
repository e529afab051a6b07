//! A spline coupling step (`crate::flow`) around its spline and conditioner, and the flow's
//! base density, as kernels for burn's CubeCL backends (wgpu, CUDA), float32, on the flow
//! state.
//!
//! On the GPU the flow carries one tensor, the **state** `s: [rows, n + 2]`: the `n`
//! features, the running log-determinant (column `n`) and a column of ones (column `n + 1`,
//! through which each step's LU map adds its bias and its log-determinant in one matrix
//! product, `crate::lu_kernel`). Three kernels each way replace what burn's composed
//! operations did in about 11 launches forward and 20 backward per flow step (gathers of the
//! two feature groups, the concatenation with the context, slices, a row sum, a
//! concatenation and a gather at the end, and their gradients' zeros, scatters and
//! additions):
//!
//! - split: the conditioner's input `[rows, (n - t) + C]`, the untransformed features next
//!   to the context `[rows, C]`; backward the state's gradient (the untransformed columns,
//!   zeros elsewhere) and the context's.
//! - the spline reads its inputs from the state's transformed columns
//!   (`crate::spline_kernel`).
//! - place: the next state from the state and the spline's `both: [rows t, 2]` (`y`,
//!   `log|dy/dx|` of row `r`'s `j`-th transformed feature at row `r t + j`): the
//!   transformed features replaced by `y`, the untransformed ones and the ones column kept,
//!   `Σ_j log|dy/dx|` added to the log-determinant; backward the state's gradient and
//!   `dboth[r t + j] = (g[r, f_j], g[r, n])`.
//!
//! The coupling's mask is Dingo's alternating one: with `start` 0 or 1, feature `f < n` is
//! transformed when `f >= start` and `f - start` is even (the `(f - start) / 2`-th
//! transformed feature, of `t = (n - start + 1) / 2`), otherwise it is the
//! `(f + start - 1) / 2`-th untransformed one (of `n - t`; the `k`-th is feature
//! `2k + 1 - start`).
//!
//! And the flow's last step, the standard normal base density with the log-determinant:
//! `lp[r] = ((-0.5 Σ_{f<n} s[r, f]² - c) + s[r, n]) - jac` (`c` = `n/2 ln 2π`, `jac` the
//! standardization's `Σ ln σ`), one launch; backward `ds[r, f] = -s[r, f] g[r]` for `f < n`,
//! `ds[r, n] = g[r]`, `ds[r, n + 1] = 0` (one launch).

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;
use cubecl::{calculate_cube_count_elemwise, CubeDim};

/// Whether feature `f` of the state's row is one the spline transforms (`f < n`).
#[cube]
fn is_transformed(f: u32, n: u32, start: u32) -> bool {
    f < n && f >= start && ((f - start) & 1) == 0
}

/// The conditioner's input `out: [rows, ids + c]` from the state `s: [rows, w]` and the
/// context `ctx: [rows, c]` (`ids = n - t` untransformed features).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn split_forward(
    s: &Array<f32>,
    ctx: &Array<f32>,
    out: &mut Array<f32>,
    rows: u32,
    w: u32,
    ids: u32,
    c: u32,
    start: u32,
) {
    let i = ABSOLUTE_POS as u32;
    let width = ids + c;
    if i >= rows * width {
        terminate!();
    }
    let r = i / width;
    let k = i % width;
    let mut v = 0.0f32;
    if k < ids {
        v += s[(r * w + 2 * k + 1 - start) as usize];
    } else {
        v += ctx[(r * c + k - ids) as usize];
    }
    out[i as usize] = v;
}

/// The gradient of [`split_forward`]: threads `0..rows w` write `ds`, threads after them
/// one entry of `dctx` each.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn split_backward(
    g: &Array<f32>,
    ds: &mut Array<f32>,
    dctx: &mut Array<f32>,
    rows: u32,
    w: u32,
    ids: u32,
    c: u32,
    start: u32,
) {
    let i = ABSOLUTE_POS as u32;
    let width = ids + c;
    let n = w - 2;
    if i >= rows * (w + c) {
        terminate!();
    }
    if i < rows * w {
        let r = i / w;
        let f = i % w;
        let mut v = 0.0f32;
        if f < n && !is_transformed(f, n, start) {
            v += g[(r * width + (f + start - 1) / 2) as usize];
        }
        ds[i as usize] = v;
    } else {
        let m = i - rows * w;
        let r = m / c;
        let k = m % c;
        dctx[m as usize] = g[(r * width + ids + k) as usize];
    }
}

/// The next state `out: [rows, w]` from the state `s` and the spline's `both: [rows t, 2]`.
#[cube(launch)]
fn place_forward(
    s: &Array<f32>,
    both: &Array<f32>,
    out: &mut Array<f32>,
    rows: u32,
    w: u32,
    t: u32,
    start: u32,
) {
    let i = ABSOLUTE_POS as u32;
    if i >= rows * w {
        terminate!();
    }
    let n = w - 2;
    let r = i / w;
    let f = i % w;
    let mut v = 0.0f32;
    if is_transformed(f, n, start) {
        v += both[((r * t + (f - start) / 2) * 2) as usize];
    } else if f == n {
        let mut ld = 0.0f32;
        for j in 0..t {
            ld += both[((r * t + j) * 2 + 1) as usize];
        }
        v += s[i as usize] + ld;
    } else {
        v += s[i as usize];
    }
    out[i as usize] = v;
}

/// The gradient of [`place_forward`]: threads `0..rows w` write `ds`, threads after them
/// one row `r t + j` of `dboth` each.
#[cube(launch)]
fn place_backward(
    g: &Array<f32>,
    ds: &mut Array<f32>,
    dboth: &mut Array<f32>,
    rows: u32,
    w: u32,
    t: u32,
    start: u32,
) {
    let i = ABSOLUTE_POS as u32;
    let n = w - 2;
    if i >= rows * (w + t) {
        terminate!();
    }
    if i < rows * w {
        let f = i % w;
        let mut v = 0.0f32;
        if !is_transformed(f, n, start) {
            v += g[i as usize];
        }
        ds[i as usize] = v;
    } else {
        let m = i - rows * w;
        let r = m / t;
        let j = m % t;
        dboth[(2 * m) as usize] = g[(r * w + start + 2 * j) as usize];
        dboth[(2 * m + 1) as usize] = g[(r * w + n) as usize];
    }
}

/// `lp[r] = ((-0.5 Σ_{f<n} s[r, f]² - c) + s[r, n]) - jac`, one thread per row.
#[cube(launch)]
fn base_forward(s: &Array<f32>, lp: &mut Array<f32>, rows: u32, w: u32, c: f32, jac: f32) {
    let r = ABSOLUTE_POS as u32;
    if r >= rows {
        terminate!();
    }
    let n = w - 2;
    let mut q = 0.0f32;
    for f in 0..n {
        let v = s[(r * w + f) as usize];
        q += v * v;
    }
    lp[r as usize] = (q * -0.5 - c + s[(r * w + n) as usize]) - jac;
}

/// `ds[r, f] = -s[r, f] g[r]` (`f < n`), `g[r]` (`f = n`), `0` (the ones).
#[cube(launch)]
fn base_backward(s: &Array<f32>, g: &Array<f32>, ds: &mut Array<f32>, rows: u32, w: u32) {
    let i = ABSOLUTE_POS as u32;
    if i >= rows * w {
        terminate!();
    }
    let n = w - 2;
    let f = i % w;
    let gr = g[(i / w) as usize];
    let mut v = 0.0f32;
    if f < n {
        v += -s[i as usize] * gr;
    } else if f == n {
        v += gr;
    }
    ds[i as usize] = v;
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

fn f32_only<R: CubeRuntime>(ts: &[&CubeTensor<R>]) {
    assert!(
        ts.iter().all(|t| t.dtype == DType::F32),
        "coupling kernel: float32 only"
    );
}

/// The transformed features `t` of a state of width `w` (`n = w - 2` features) for the mask
/// starting at `start`.
pub fn transformed_count(w: usize, start: usize) -> usize {
    let n = w.saturating_sub(2);
    n.saturating_sub(start).div_ceil(2)
}

/// `(rows, w)` of a state, checked.
fn state_dims<R: CubeRuntime>(s: &CubeTensor<R>, start: usize) -> (usize, usize) {
    let shape = s.shape();
    assert!(
        shape.num_dims() == 2 && shape[1] >= 3 && start <= 1,
        "coupling kernel: the state is not [rows, n + 2] with n >= 1 (start {start})"
    );
    (shape[0], shape[1])
}

/// The conditioner's input `[rows, (n - t) + C]`: the state's untransformed features
/// (`s: [rows, n + 2]`, mask from `start`) next to the context `ctx: [rows, C]`. One launch.
///
/// Panics on shapes that do not fit or a dtype other than float32.
pub fn split_forward_launch<R: CubeRuntime>(
    s: CubeTensor<R>,
    ctx: CubeTensor<R>,
    start: usize,
) -> CubeTensor<R> {
    f32_only(&[&s, &ctx]);
    let (rows, w) = state_dims(&s, start);
    let [crows, c] = ctx.shape().dims::<2>();
    assert_eq!(crows, rows, "coupling kernel: the context's rows");
    let ids = w - 2 - transformed_count(w, start);
    let [s, ctx] = [s, ctx].map(into_contiguous);
    let out = empty_device::<R, f32>(
        s.client.clone(),
        s.device.clone(),
        Shape::new([rows, ids + c]),
    );
    let (count, dim) = grid(&s, rows * (ids + c));
    split_forward::launch::<R>(
        &s.client.clone(),
        count,
        dim,
        s.into_array_arg(),
        ctx.into_array_arg(),
        out.clone().into_array_arg(),
        rows as u32,
        w as u32,
        ids as u32,
        c as u32,
        start as u32,
    );
    out
}

/// The gradients `(ds [rows, w], dctx [rows, C])` of [`split_forward_launch`] for the
/// incoming `g: [rows, (n - t) + C]` and a state of width `w`. One launch.
///
/// Panics on shapes that do not fit or a dtype other than float32.
pub fn split_backward_launch<R: CubeRuntime>(
    g: CubeTensor<R>,
    w: usize,
    start: usize,
) -> (CubeTensor<R>, CubeTensor<R>) {
    f32_only(&[&g]);
    let [rows, width] = g.shape().dims::<2>();
    let ids = w - 2 - transformed_count(w, start);
    assert!(width >= ids, "coupling kernel: the split's gradient");
    let c = width - ids;
    let g = into_contiguous(g);
    let new =
        |s: [usize; 2]| empty_device::<R, f32>(g.client.clone(), g.device.clone(), Shape::new(s));
    let (ds, dctx) = (new([rows, w]), new([rows, c]));
    let (count, dim) = grid(&g, rows * (w + c));
    split_backward::launch::<R>(
        &g.client.clone(),
        count,
        dim,
        g.into_array_arg(),
        ds.clone().into_array_arg(),
        dctx.clone().into_array_arg(),
        rows as u32,
        w as u32,
        ids as u32,
        c as u32,
        start as u32,
    );
    (ds, dctx)
}

/// The next state `[rows, w]` from the state `s: [rows, w]` and the spline's
/// `both: [rows t, 2]`, the mask from `start` (see the module docs). One launch.
///
/// Panics on shapes that do not fit or a dtype other than float32.
pub fn place_forward_launch<R: CubeRuntime>(
    s: CubeTensor<R>,
    both: CubeTensor<R>,
    start: usize,
) -> CubeTensor<R> {
    f32_only(&[&s, &both]);
    let (rows, w) = state_dims(&s, start);
    let t = transformed_count(w, start);
    assert_eq!(
        both.shape().dims::<2>(),
        [rows * t, 2],
        "coupling kernel: the spline's output is not [rows t, 2]"
    );
    let [s, both] = [s, both].map(into_contiguous);
    let out = empty_device::<R, f32>(s.client.clone(), s.device.clone(), Shape::new([rows, w]));
    let (count, dim) = grid(&s, rows * w);
    place_forward::launch::<R>(
        &s.client.clone(),
        count,
        dim,
        s.into_array_arg(),
        both.into_array_arg(),
        out.clone().into_array_arg(),
        rows as u32,
        w as u32,
        t as u32,
        start as u32,
    );
    out
}

/// The gradients `(ds [rows, w], dboth [rows t, 2])` of [`place_forward_launch`] for the
/// incoming `g: [rows, w]`. One launch.
///
/// Panics on a dtype other than float32.
pub fn place_backward_launch<R: CubeRuntime>(
    g: CubeTensor<R>,
    start: usize,
) -> (CubeTensor<R>, CubeTensor<R>) {
    f32_only(&[&g]);
    let (rows, w) = state_dims(&g, start);
    let t = transformed_count(w, start);
    let g = into_contiguous(g);
    let new =
        |s: [usize; 2]| empty_device::<R, f32>(g.client.clone(), g.device.clone(), Shape::new(s));
    let (ds, dboth) = (new([rows, w]), new([rows * t, 2]));
    let (count, dim) = grid(&g, rows * (w + t));
    place_backward::launch::<R>(
        &g.client.clone(),
        count,
        dim,
        g.into_array_arg(),
        ds.clone().into_array_arg(),
        dboth.clone().into_array_arg(),
        rows as u32,
        w as u32,
        t as u32,
        start as u32,
    );
    (ds, dboth)
}

/// The base log-density with the log-determinant, `lp: [rows]` from the state
/// `s: [rows, n + 2]` (see the module docs; `c` and `jac` rounded to float32). One launch.
///
/// Panics on shapes that do not fit or a dtype other than float32.
pub fn base_forward_launch<R: CubeRuntime>(s: CubeTensor<R>, c: f64, jac: f64) -> CubeTensor<R> {
    f32_only(&[&s]);
    let (rows, w) = state_dims(&s, 0);
    let s = into_contiguous(s);
    let lp = empty_device::<R, f32>(s.client.clone(), s.device.clone(), Shape::new([rows]));
    let (count, dim) = grid(&s, rows);
    base_forward::launch::<R>(
        &s.client.clone(),
        count,
        dim,
        s.into_array_arg(),
        lp.clone().into_array_arg(),
        rows as u32,
        w as u32,
        c as f32,
        jac as f32,
    );
    lp
}

/// The gradient `ds: [rows, n + 2]` of [`base_forward_launch`] for the incoming
/// `g: [rows]`. One launch.
///
/// Panics on shapes that do not fit or a dtype other than float32.
pub fn base_backward_launch<R: CubeRuntime>(s: CubeTensor<R>, g: CubeTensor<R>) -> CubeTensor<R> {
    f32_only(&[&s, &g]);
    let (rows, w) = state_dims(&s, 0);
    assert_eq!(
        g.shape().num_elements(),
        rows,
        "coupling kernel: the base's gradient"
    );
    let [s, g] = [s, g].map(into_contiguous);
    let ds = empty_device::<R, f32>(s.client.clone(), s.device.clone(), Shape::new([rows, w]));
    let (count, dim) = grid(&s, rows * w);
    base_backward::launch::<R>(
        &s.client.clone(),
        count,
        dim,
        s.into_array_arg(),
        g.into_array_arg(),
        ds.clone().into_array_arg(),
        rows as u32,
        w as u32,
    );
    ds
}
