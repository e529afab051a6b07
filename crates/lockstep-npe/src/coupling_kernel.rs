//! The end of a spline coupling step (`crate::flow`) as kernels for burn's CubeCL backends
//! (wgpu, CUDA), float32: placing the untransformed features and the spline's outputs back
//! in feature order, and adding the spline's log-derivatives to the running
//! log-determinant, one launch each way each, where burn's composed operations launch 7
//! kernels forward (two column slices of the spline's `[M, 2]` output, a row sum, a
//! concatenation, a gather, an addition) and about 12 backward per flow step.
//!
//! The coupling's mask is Dingo's alternating one: with `start` 0 or 1, feature `f` of
//! `d` is transformed when `f >= start` and `f - start` is even (the `(f - start) / 2`-th
//! transformed feature, of `t`), otherwise it is the `(f + start - 1) / 2`-th untransformed
//! one (of `d - t`). `both: [N t, 2]` holds the spline's `y` and `log|dy/dx|` for row
//! `r`'s `j`-th transformed feature at row `r t + j`.
//!
//! - place: `z[r, f] = both[r t + j, 0]` for a transformed `f`, else `x_id[r, k]`;
//!   backward `dx_id[r, k] = g[r, f]`, `dboth[r t + j] = (g[r, f], 0)`.
//! - log-determinant: `out[r] = acc[r] + Σ_j both[r t + j, 1]`; backward `dacc = g`
//!   (no kernel), `dboth[r t + j] = (0, g[r])`.
//!
//! And the flow's last step, the standard normal base density with the log-determinant:
//! `lp[r] = ((-0.5 Σ_j z[r, j]² - c) + logdet[r]) - jac` for `z: [rows, d]` (`c` =
//! `d/2 ln 2π`, `jac` the standardization's `Σ ln σ`), one launch where burn's composed
//! operations launch 6; backward `dz[r, j] = -z[r, j] g[r]` (one launch), `dlogdet = g`.

use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;
use cubecl::{calculate_cube_count_elemwise, CubeDim};

/// `z: [rows, d]` from `x_id: [rows, d - t]` and `both: [rows t, 2]`.
#[cube(launch)]
fn place_forward(
    x_id: &Array<f32>,
    both: &Array<f32>,
    z: &mut Array<f32>,
    rows: u32,
    d: u32,
    t: u32,
    start: u32,
) {
    let i = ABSOLUTE_POS as u32;
    if i >= rows * d {
        terminate!();
    }
    let r = i / d;
    let f = i % d;
    let mut v = 0.0f32;
    // Transformed: `f - start` even (its lowest bit clear).
    if f >= start && ((f - start) & 1) == 0 {
        v += both[((r * t + (f - start) / 2) * 2) as usize];
    } else {
        v += x_id[(r * (d - t) + (f + start - 1) / 2) as usize];
    }
    z[i as usize] = v;
}

/// The gradient of [`place_forward`]: threads `0..rows (d - t)` write `dx_id`, threads
/// after them one row `r t + j` of `dboth` each.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn place_backward(
    g: &Array<f32>,
    dx_id: &mut Array<f32>,
    dboth: &mut Array<f32>,
    rows: u32,
    d: u32,
    t: u32,
    start: u32,
) {
    let i = ABSOLUTE_POS as u32;
    let ids = rows * (d - t);
    if i >= ids + rows * t {
        terminate!();
    }
    if i < ids {
        let r = i / (d - t);
        let k = i % (d - t);
        // The k-th untransformed feature: 2k + 1 - start.
        dx_id[i as usize] = g[(r * d + 2 * k + 1 - start) as usize];
    } else {
        let m = i - ids;
        let r = m / t;
        let j = m % t;
        dboth[(2 * m) as usize] = g[(r * d + start + 2 * j) as usize];
        dboth[(2 * m + 1) as usize] = 0.0;
    }
}

/// `out[r] = acc[r] + Σ_j both[r t + j, 1]`.
#[cube(launch)]
fn logdet_forward(acc: &Array<f32>, both: &Array<f32>, out: &mut Array<f32>, rows: u32, t: u32) {
    let r = ABSOLUTE_POS as u32;
    if r >= rows {
        terminate!();
    }
    let mut s = 0.0f32;
    for j in 0..t {
        s += both[((r * t + j) * 2 + 1) as usize];
    }
    out[r as usize] = acc[r as usize] + s;
}

/// `dboth[r t + j] = (0, g[r])`.
#[cube(launch)]
fn logdet_backward(g: &Array<f32>, dboth: &mut Array<f32>, rows: u32, t: u32) {
    let m = ABSOLUTE_POS as u32;
    if m >= rows * t {
        terminate!();
    }
    dboth[(2 * m) as usize] = 0.0;
    dboth[(2 * m + 1) as usize] = g[(m / t) as usize];
}

/// `lp[r] = ((-0.5 Σ_j z[r, j]² - c) + logdet[r]) - jac`, one thread per row.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn base_forward(
    z: &Array<f32>,
    logdet: &Array<f32>,
    lp: &mut Array<f32>,
    rows: u32,
    d: u32,
    c: f32,
    jac: f32,
) {
    let r = ABSOLUTE_POS as u32;
    if r >= rows {
        terminate!();
    }
    let mut s = 0.0f32;
    for j in 0..d {
        let v = z[(r * d + j) as usize];
        s += v * v;
    }
    lp[r as usize] = (s * -0.5 - c + logdet[r as usize]) - jac;
}

/// `dz[r, j] = -z[r, j] g[r]`.
#[cube(launch)]
fn base_backward(z: &Array<f32>, g: &Array<f32>, dz: &mut Array<f32>, rows: u32, d: u32) {
    let i = ABSOLUTE_POS as u32;
    if i >= rows * d {
        terminate!();
    }
    dz[i as usize] = -z[i as usize] * g[(i / d) as usize];
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

/// `(rows, t)` of `both: [rows t, 2]` for `rows` rows.
fn transformed<R: CubeRuntime>(both: &CubeTensor<R>, rows: usize) -> u32 {
    let shape = both.shape();
    assert!(
        shape.num_dims() == 2 && shape[1] == 2 && rows > 0 && shape[0].is_multiple_of(rows),
        "coupling kernel: the spline's output is not [rows t, 2]"
    );
    (shape[0] / rows) as u32
}

/// The coupling's output `z: [rows, d]` in feature order from the untransformed features
/// `x_id: [rows, d - t]` and the spline's `both: [rows t, 2]`, the mask alternating from
/// `start` (see the module docs). One launch.
///
/// Panics on shapes that do not fit or a dtype other than float32.
pub fn place_forward_launch<R: CubeRuntime>(
    x_id: CubeTensor<R>,
    both: CubeTensor<R>,
    start: usize,
) -> CubeTensor<R> {
    f32_only(&[&x_id, &both]);
    let shape = x_id.shape();
    let rows = shape[0];
    let t = transformed(&both, rows);
    let d = shape[1] as u32 + t;
    let [x_id, both] = [x_id, both].map(into_contiguous);
    let z = empty_device::<R, f32>(
        x_id.client.clone(),
        x_id.device.clone(),
        Shape::new([rows, d as usize]),
    );
    let (count, dim) = grid(&x_id, rows * d as usize);
    place_forward::launch::<R>(
        &x_id.client.clone(),
        count,
        dim,
        x_id.into_array_arg(),
        both.into_array_arg(),
        z.clone().into_array_arg(),
        rows as u32,
        d,
        t,
        start as u32,
    );
    z
}

/// The gradients `(dx_id [rows, d - t], dboth [rows t, 2])` of [`place_forward_launch`]
/// for the incoming gradient `g: [rows, d]`, `t` transformed features. One launch.
///
/// Panics on a dtype other than float32.
pub fn place_backward_launch<R: CubeRuntime>(
    g: CubeTensor<R>,
    t: usize,
    start: usize,
) -> (CubeTensor<R>, CubeTensor<R>) {
    f32_only(&[&g]);
    let shape = g.shape();
    let (rows, d) = (shape[0], shape[1]);
    let g = into_contiguous(g);
    let new =
        |s: [usize; 2]| empty_device::<R, f32>(g.client.clone(), g.device.clone(), Shape::new(s));
    let (dx_id, dboth) = (new([rows, d - t]), new([rows * t, 2]));
    let (count, dim) = grid(&g, rows * d);
    place_backward::launch::<R>(
        &g.client.clone(),
        count,
        dim,
        g.into_array_arg(),
        dx_id.clone().into_array_arg(),
        dboth.clone().into_array_arg(),
        rows as u32,
        d as u32,
        t as u32,
        start as u32,
    );
    (dx_id, dboth)
}

/// The running log-determinant `acc: [rows]` plus each row's sum of the spline's
/// log-derivatives (`both: [rows t, 2]`, column 1). One launch.
///
/// Panics on shapes that do not fit or a dtype other than float32.
pub fn logdet_forward_launch<R: CubeRuntime>(
    acc: CubeTensor<R>,
    both: CubeTensor<R>,
) -> CubeTensor<R> {
    f32_only(&[&acc, &both]);
    let rows = acc.shape().num_elements();
    let t = transformed(&both, rows);
    let [acc, both] = [acc, both].map(into_contiguous);
    let out = empty_device::<R, f32>(acc.client.clone(), acc.device.clone(), acc.shape());
    let (count, dim) = grid(&acc, rows);
    logdet_forward::launch::<R>(
        &acc.client.clone(),
        count,
        dim,
        acc.into_array_arg(),
        both.into_array_arg(),
        out.clone().into_array_arg(),
        rows as u32,
        t,
    );
    out
}

/// The gradient `dboth: [rows t, 2]` of [`logdet_forward_launch`] for the incoming
/// gradient `g: [rows]`. One launch.
///
/// Panics on a dtype other than float32.
pub fn logdet_backward_launch<R: CubeRuntime>(g: CubeTensor<R>, t: usize) -> CubeTensor<R> {
    f32_only(&[&g]);
    let rows = g.shape().num_elements();
    let g = into_contiguous(g);
    let dboth = empty_device::<R, f32>(
        g.client.clone(),
        g.device.clone(),
        Shape::new([rows * t, 2]),
    );
    let (count, dim) = grid(&g, rows * t);
    logdet_backward::launch::<R>(
        &g.client.clone(),
        count,
        dim,
        g.into_array_arg(),
        dboth.clone().into_array_arg(),
        rows as u32,
        t as u32,
    );
    dboth
}

/// The base log-density with the log-determinant, `lp: [rows]` from `z: [rows, d]` and
/// `logdet: [rows]` (see the module docs; `c` and `jac` rounded to float32). One launch.
///
/// Panics on shapes that do not fit or a dtype other than float32.
pub fn base_forward_launch<R: CubeRuntime>(
    z: CubeTensor<R>,
    logdet: CubeTensor<R>,
    c: f64,
    jac: f64,
) -> CubeTensor<R> {
    f32_only(&[&z, &logdet]);
    let shape = z.shape();
    let rows = logdet.shape().num_elements();
    assert!(
        shape.num_dims() == 2 && shape[0] == rows,
        "coupling kernel: z is not [rows, d] for {rows} log-determinants"
    );
    let d = shape[1];
    let [z, logdet] = [z, logdet].map(into_contiguous);
    let lp = empty_device::<R, f32>(z.client.clone(), z.device.clone(), logdet.shape());
    let (count, dim) = grid(&z, rows);
    base_forward::launch::<R>(
        &z.client.clone(),
        count,
        dim,
        z.into_array_arg(),
        logdet.into_array_arg(),
        lp.clone().into_array_arg(),
        rows as u32,
        d as u32,
        c as f32,
        jac as f32,
    );
    lp
}

/// The gradient `dz: [rows, d]` of [`base_forward_launch`] for the incoming `g: [rows]`
/// (that of `logdet` is `g`). One launch.
///
/// Panics on shapes that do not fit or a dtype other than float32.
pub fn base_backward_launch<R: CubeRuntime>(z: CubeTensor<R>, g: CubeTensor<R>) -> CubeTensor<R> {
    f32_only(&[&z, &g]);
    let shape = z.shape();
    let rows = g.shape().num_elements();
    assert!(
        shape.num_dims() == 2 && shape[0] == rows,
        "coupling kernel: z is not [rows, d] for {rows} gradients"
    );
    let d = shape[1];
    let [z, g] = [z, g].map(into_contiguous);
    let dz = empty_device::<R, f32>(z.client.clone(), z.device.clone(), shape);
    let (count, dim) = grid(&z, rows * d);
    base_backward::launch::<R>(
        &z.client.clone(),
        count,
        dim,
        z.into_array_arg(),
        g.into_array_arg(),
        dz.clone().into_array_arg(),
        rows as u32,
        d as u32,
    );
    dz
}
