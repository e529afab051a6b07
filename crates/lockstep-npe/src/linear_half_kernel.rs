//! Mixed precision's linear layer ([`crate::fused_ops::Precision::Half`]) with its bias and
//! its casts inside two kernels, for burn's CubeCL backends (wgpu with `SHADER_F16`, CUDA):
//! the matrix products stay burn's (float16), and around them
//!
//! - forward: `y[r, c] = f32(a[r, c] + f16(bias[c]))` from the float16 product `a = x Wᵀ`
//!   and the float32 bias, the addition in float16 (one launch where the composed form
//!   casts the bias, adds and casts the result back: 3);
//!   With the ELU that follows, `yh = elu(a + f16(bias))` in float16 (one launch where
//!   the bias and the activation took two and the next product's cast a third);
//! - backward: from the float16 products `dx = g W`, `dW = gᵀ x` and the float16 incoming
//!   gradient `g`, the float32 `dx`, `dW` and `db[c] = f32(f16(Σ_r g[r, c]))` (the sum
//!   accumulated in float32) in one launch where the composed form casts three times and
//!   reduces once: 4.
//!
//! PyTorch's autocast computes the same things (`addmm` in float16, the casts of its
//! output); only the bias gradient's summation order differs from burn's float16 reduction.

use burn::tensor::{f16, DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;
use cubecl::{calculate_cube_count_elemwise, CubeDim};

/// `y[i] = f32(a[i] + f16(bias[i % cols]))`, `i < n`.
#[cube(launch)]
fn half_bias_forward(a: &Array<f16>, bias: &Array<f32>, y: &mut Array<f32>, n: u32, cols: u32) {
    let i = ABSOLUTE_POS as u32;
    if i >= n {
        terminate!();
    }
    let b = f16::cast_from(bias[(i % cols) as usize]);
    y[i as usize] = f32::cast_from(a[i as usize] + b);
}

/// `yh[i] = elu(a[i] + f16(bias[i % cols]))`, `i < n`, the addition and the ELU in
/// float16 arithmetic (autocast's `addmm` and the ELU on its float16 output).
#[cube(launch)]
fn half_bias_elu_forward(
    a: &Array<f16>,
    bias: &Array<f32>,
    yh: &mut Array<f16>,
    n: u32,
    cols: u32,
) {
    let i = ABSOLUTE_POS as u32;
    if i >= n {
        terminate!();
    }
    let b = f16::cast_from(bias[(i % cols) as usize]);
    yh[i as usize] = crate::activation_kernel::elu_value::<f16>(a[i as usize] + b);
}

/// Thread `i`: `dx[i] = f32(dxh[i])` (`i < ndx`), `dw[i] = f32(dwh[i])` (`i < ndw`),
/// `db[i] = f32(f16(Σ_r g[r cols + i]))` (`i < cols`).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn half_linear_backward(
    dxh: &Array<f16>,
    dwh: &Array<f16>,
    g: &Array<f16>,
    dx: &mut Array<f32>,
    dw: &mut Array<f32>,
    db: &mut Array<f32>,
    ndx: u32,
    ndw: u32,
    rows: u32,
    cols: u32,
) {
    let i = ABSOLUTE_POS as u32;
    if i < ndx {
        dx[i as usize] = f32::cast_from(dxh[i as usize]);
    }
    if i < ndw {
        dw[i as usize] = f32::cast_from(dwh[i as usize]);
    }
    if i < cols {
        let mut s = 0.0f32;
        for r in 0..rows {
            s += f32::cast_from(g[(r * cols + i) as usize]);
        }
        db[i as usize] = f32::cast_from(f16::cast_from(s));
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

/// `f32(a + f16(bias))` for the float16 product `a: [rows, cols]` and the float32
/// `bias: [cols]`: a new float32 `[rows, cols]`; with `elu`, `elu(a + f16(bias))` in
/// float16 instead, a new float16 `[rows, cols]` (for the float16 product that reads it
/// next). One launch.
///
/// Panics on other dtypes or shapes that do not fit.
pub fn bias_forward_launch<R: CubeRuntime>(
    a: CubeTensor<R>,
    bias: CubeTensor<R>,
    elu: bool,
) -> CubeTensor<R> {
    assert!(
        a.dtype == DType::F16 && bias.dtype == DType::F32,
        "half linear kernel: a float16 product and a float32 bias ({:?}, {:?})",
        a.dtype,
        bias.dtype
    );
    let shape = a.shape();
    let cols = bias.shape().num_elements();
    assert!(
        shape.num_dims() == 2 && shape[1] == cols,
        "half linear kernel: the product is not [rows, {cols}]"
    );
    let n = shape.num_elements();
    let (a, bias) = (into_contiguous(a), into_contiguous(bias));
    let (client, device) = (a.client.clone(), a.device.clone());
    let (count, dim) = grid(&a, n);
    let n = u32::try_from(n).expect("half linear kernel: fewer than 2^32 values");
    let (a, b) = (a.into_array_arg(), bias.into_array_arg());
    if elu {
        let yh = empty_device::<R, f16>(client.clone(), device, shape);
        let out = yh.clone().into_array_arg();
        half_bias_elu_forward::launch::<R>(&client, count, dim, a, b, out, n, cols as u32);
        yh
    } else {
        let y = empty_device::<R, f32>(client.clone(), device, shape);
        let out = y.clone().into_array_arg();
        half_bias_forward::launch::<R>(&client, count, dim, a, b, out, n, cols as u32);
        y
    }
}

/// The float32 gradients `(dx, dW, db)` of a mixed-precision linear layer from the float16
/// products `dxh` (`[rows, inputs]`, when the input needs one), `dwh` (`[outputs *
/// inputs]`, when the weight needs one) and the float16 incoming gradient `g: [rows,
/// outputs]` (`db: [outputs]`, always computed). One launch.
///
/// Panics on dtypes other than float16 or shapes that do not fit.
pub fn gradients_launch<R: CubeRuntime>(
    dxh: Option<CubeTensor<R>>,
    dwh: Option<CubeTensor<R>>,
    g: CubeTensor<R>,
) -> (Option<CubeTensor<R>>, Option<CubeTensor<R>>, CubeTensor<R>) {
    let all_half = [Some(&g), dxh.as_ref(), dwh.as_ref()]
        .iter()
        .flatten()
        .all(|t| t.dtype == DType::F16);
    assert!(
        all_half,
        "half linear kernel: float16 products and gradient"
    );
    let shape = g.shape();
    assert_eq!(
        shape.num_dims(),
        2,
        "half linear kernel: g is not [rows, outputs]"
    );
    let (rows, cols) = (shape[0], shape[1]);
    let g = into_contiguous(g);
    let (client, device) = (g.client.clone(), g.device.clone());
    let float = |s: Shape| empty_device::<R, f32>(client.clone(), device.clone(), s);
    let dxh = dxh.map(into_contiguous);
    let dwh = dwh.map(into_contiguous);
    let dx = dxh.as_ref().map(|t| float(t.shape()));
    let dw = dwh.as_ref().map(|t| float(t.shape()));
    let db = float(Shape::new([cols]));
    let count_of = |t: &Option<CubeTensor<R>>| t.as_ref().map_or(0, |t| t.shape().num_elements());
    let (ndx, ndw) = (count_of(&dxh), count_of(&dwh));
    let threads = ndx.max(ndw).max(cols);
    // Absent products bind the gradient (read by no thread) and a one-value output.
    let (count, dim) = grid(&g, threads);
    let dummy = || float(Shape::new([1]));
    let u = |n: usize| u32::try_from(n).expect("half linear kernel: fewer than 2^32 values");
    half_linear_backward::launch::<R>(
        &client,
        count,
        dim,
        dxh.unwrap_or_else(|| g.clone()).into_array_arg(),
        dwh.unwrap_or_else(|| g.clone()).into_array_arg(),
        g.into_array_arg(),
        dx.clone().unwrap_or_else(dummy).into_array_arg(),
        dw.clone().unwrap_or_else(dummy).into_array_arg(),
        db.clone().into_array_arg(),
        u(ndx),
        u(ndw),
        u(rows),
        u(cols),
    );
    (dx, dw, db)
}
