//! ELU and the logistic sigmoid, forward and backward, as one GPU kernel each for burn's
//! CubeCL backends (wgpu, CUDA), float32 and float16: where the composed burn operations
//! launch five kernels for ELU's forward pass (a comparison, a clamp, `exp`, a subtraction,
//! a masked select) and four for its backward pass, and four each way for the sigmoid.
//!
//! One thread per element of a contiguous tensor of `n` values. The arithmetic is that of
//! the composed forms ([`crate::fused_ops::FusedOps`]'s defaults), in the same order, but
//! for ELU's small negative arguments:
//!
//! - ELU (α = 1): `y = x` for `x > 0`, else `e^x - 1`, computed as `expm1` for
//!   `-1/2 < x <= 0` (its Taylor series to `x^8`, where the composed `exp(x) - 1` loses the
//!   digits of a small `x`: 19% at `x = -1e-7`; Kahan's `(u - 1) x / ln u` needs an
//!   accurate `ln` near 1, which lavapipe's is not); backward `dx = g` where `y > 0`,
//!   else `g (y + 1)`;
//! - sigmoid: `s = 1 / (1 + exp(-x))`; backward `dx = (g s) (1 - s)`.
//!
//! The kernels are generic over the float type: float16 tensors run the same kernels in
//! float16 arithmetic. Mixed precision's path (float32 in, the activation computed in
//! float16 and returned in float32 for the sigmoid, in float16 for the ELU, whose output a
//! float16 product reads next; see [`crate::fused_ops::Precision`]) has a kernel each way
//! with the casts inside ([`half_forward_launch`], [`half_backward_launch`]), where separate
//! casts took two more launches each way.

use burn::tensor::{f16, DType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;
use cubecl::{calculate_cube_count_elemwise, CubeDim};

/// Which activation a kernel computes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    /// ELU with α = 1.
    Elu,
    /// The logistic sigmoid.
    Sigmoid,
}

/// ELU (α = 1) of one value: `v` for `v > 0`, else `e^v - 1` (near 0 its Taylor series).
#[cube]
pub(crate) fn elu_value<F: Float>(v: F) -> F {
    let mut out = v;
    if v <= F::new(0.0) {
        out = F::exp(v) - F::new(1.0);
        // Near 0, `e^x - 1` cancels (x = -1e-7 gives -1.19e-7): the Taylor series to x^8
        // (truncation below 3e-7 relative for -1/2 < x <= 0).
        // Coefficients 1/k! for k = 2..8.
        if v > F::new(-0.5) {
            let p8 = v * F::new(2.480_158_7e-5) + F::new(1.984_127e-4);
            let p7 = v * p8 + F::new(1.388_888_9e-3);
            let p6 = v * p7 + F::new(8.333_334e-3);
            let p5 = v * p6 + F::new(4.166_666_8e-2);
            let p4 = v * p5 + F::new(0.166_666_67);
            let p3 = v * p4 + F::new(0.5);
            out = v * (v * p3 + F::new(1.0));
        }
    }
    out
}

/// `y[i] = elu(x[i])` for `i < n`.
#[cube(launch)]
fn elu_forward<F: Float>(x: &Array<F>, y: &mut Array<F>, n: u32) {
    let i = ABSOLUTE_POS as u32;
    if i >= n {
        terminate!();
    }
    y[i as usize] = elu_value::<F>(x[i as usize]);
}

/// `dx[i] = g[i]` where `y[i] > 0`, else `g[i] (y[i] + 1)`, for `i < n`.
#[cube(launch)]
fn elu_backward<F: Float>(y: &Array<F>, g: &Array<F>, dx: &mut Array<F>, n: u32) {
    let i = ABSOLUTE_POS as u32;
    if i >= n {
        terminate!();
    }
    let yi = y[i as usize];
    let mut d = yi + F::new(1.0);
    if yi > F::new(0.0) {
        d = F::new(1.0);
    }
    dx[i as usize] = g[i as usize] * d;
}

/// `s[i] = 1 / (1 + exp(-x[i]))` for `i < n`.
#[cube(launch)]
fn sigmoid_forward<F: Float>(x: &Array<F>, s: &mut Array<F>, n: u32) {
    let i = ABSOLUTE_POS as u32;
    if i >= n {
        terminate!();
    }
    s[i as usize] = F::new(1.0) / (F::exp(-x[i as usize]) + F::new(1.0));
}

/// `dx[i] = (g[i] s[i]) (1 - s[i])` for `i < n`.
#[cube(launch)]
fn sigmoid_backward<F: Float>(s: &Array<F>, g: &Array<F>, dx: &mut Array<F>, n: u32) {
    let i = ABSOLUTE_POS as u32;
    if i >= n {
        terminate!();
    }
    let si = s[i as usize];
    dx[i as usize] = g[i as usize] * si * (F::new(1.0) - si);
}

/// Mixed precision's activation with its casts inside: `yh[i] = act(f16(x[i]))` in
/// float16 arithmetic and, when `wide` is 1, `y[i] = f32(yh[i])`, for `i < n` (`elu` 1:
/// ELU, 0: sigmoid).
#[cube(launch)]
fn half_forward(
    x: &Array<f32>,
    y: &mut Array<f32>,
    yh: &mut Array<f16>,
    n: u32,
    elu: u32,
    wide: u32,
) {
    let i = ABSOLUTE_POS as u32;
    if i >= n {
        terminate!();
    }
    let v = f16::cast_from(x[i as usize]);
    let mut out = f16::new(1.0) / (f16::exp(-v) + f16::new(1.0));
    if elu == 1 {
        out = elu_value::<f16>(v);
    }
    yh[i as usize] = out;
    if wide == 1 {
        y[i as usize] = f32::cast_from(out);
    }
}

/// The gradient of [`half_forward`] from its float16 output `yh` and the incoming gradient
/// `g` (float32, or float16): `dx[i] = D(f16(g[i]) act'(yh[i]))`, in float16 arithmetic,
/// `D` the output's type (float32, or float16 for a float16 matrix product before it).
#[cube(launch)]
fn half_backward<G: Float, D: Float>(
    yh: &Array<f16>,
    g: &Array<G>,
    dx: &mut Array<D>,
    n: u32,
    elu: u32,
) {
    let i = ABSOLUTE_POS as u32;
    if i >= n {
        terminate!();
    }
    let yi = yh[i as usize];
    let gi = f16::cast_from(g[i as usize]);
    let mut d = gi * yi * (f16::new(1.0) - yi);
    if elu == 1 {
        let mut slope = yi + f16::new(1.0);
        if yi > f16::new(0.0) {
            slope = f16::new(1.0);
        }
        d = gi * slope;
    }
    dx[i as usize] = D::cast_from(d);
}

/// Whether the kernels take `t` (float32 or float16; any shape, made contiguous first).
pub fn supports<R: CubeRuntime>(t: &CubeTensor<R>) -> bool {
    supports_dtype(t.dtype)
}

/// Whether the kernels take tensors of `dtype` (float32, float16).
pub fn supports_dtype(dtype: DType) -> bool {
    matches!(dtype, DType::F32 | DType::F16)
}

/// The element count of `t` as the kernels' `n`, and the launch grid for it.
fn grid<R: CubeRuntime>(t: &CubeTensor<R>) -> (u32, CubeCount, CubeDim) {
    let n = t.shape().num_elements();
    let client = &t.client;
    let cube_dim = CubeDim::new(client, n.max(1));
    let count = calculate_cube_count_elemwise(client, n.max(1), cube_dim);
    (
        u32::try_from(n).expect("activation kernel: fewer than 2^32 values"),
        count,
        cube_dim,
    )
}

/// A new tensor of `like`'s shape, dtype and device.
fn empty_like<R: CubeRuntime>(like: &CubeTensor<R>) -> CubeTensor<R> {
    let (client, device) = (like.client.clone(), like.device.clone());
    match like.dtype {
        DType::F16 => empty_device::<R, f16>(client, device, like.shape()),
        _ => empty_device::<R, f32>(client, device, like.shape()),
    }
}

/// The activation of `x` (float32 or float16, any shape), elementwise, in one launch: a new
/// tensor of `x`'s shape and dtype, computed in that dtype.
///
/// Panics on another dtype ([`supports`]).
pub fn forward<R: CubeRuntime>(activation: Activation, x: CubeTensor<R>) -> CubeTensor<R> {
    assert!(
        supports(&x),
        "activation kernel: float32 or float16 only ({:?})",
        x.dtype
    );
    let x = into_contiguous(x);
    let client = x.client.clone();
    let out = empty_like(&x);
    let (n, count, dim) = grid(&x);
    let half = x.dtype == DType::F16;
    let (input, output) = (x.into_array_arg(), out.clone().into_array_arg());
    match (activation, half) {
        (Activation::Elu, false) => {
            elu_forward::launch::<f32, R>(&client, count, dim, input, output, n)
        }
        (Activation::Elu, true) => {
            elu_forward::launch::<f16, R>(&client, count, dim, input, output, n)
        }
        (Activation::Sigmoid, false) => {
            sigmoid_forward::launch::<f32, R>(&client, count, dim, input, output, n)
        }
        (Activation::Sigmoid, true) => {
            sigmoid_forward::launch::<f16, R>(&client, count, dim, input, output, n)
        }
    }
    out
}

/// The gradient of [`forward`] from its output `y` and the incoming gradient `grad` (both
/// float32 or both float16, the same shape), in one launch.
///
/// Panics on other dtypes or shapes that differ.
pub fn backward<R: CubeRuntime>(
    activation: Activation,
    y: CubeTensor<R>,
    grad: CubeTensor<R>,
) -> CubeTensor<R> {
    assert!(
        supports(&y) && y.dtype == grad.dtype,
        "activation kernel: float32 or float16 only, one dtype ({:?}, {:?})",
        y.dtype,
        grad.dtype
    );
    assert_eq!(y.shape(), grad.shape(), "activation kernel: shapes differ");
    let (y, grad) = (into_contiguous(y), into_contiguous(grad));
    let client = y.client.clone();
    let dx = empty_like(&y);
    let (n, count, dim) = grid(&y);
    let half = y.dtype == DType::F16;
    let (ya, ga, da) = (
        y.into_array_arg(),
        grad.into_array_arg(),
        dx.clone().into_array_arg(),
    );
    match (activation, half) {
        (Activation::Elu, false) => {
            elu_backward::launch::<f32, R>(&client, count, dim, ya, ga, da, n)
        }
        (Activation::Elu, true) => {
            elu_backward::launch::<f16, R>(&client, count, dim, ya, ga, da, n)
        }
        (Activation::Sigmoid, false) => {
            sigmoid_backward::launch::<f32, R>(&client, count, dim, ya, ga, da, n)
        }
        (Activation::Sigmoid, true) => {
            sigmoid_backward::launch::<f16, R>(&client, count, dim, ya, ga, da, n)
        }
    }
    dx
}

/// Mixed precision's activation of a float32 `x` with the casts inside one launch:
/// `(y float32, yh float16)`, `yh` the activation computed in float16 on `x` cast to
/// float16 and `y` its float32 copy (what `x.cast(F16)`, the float16 kernel and
/// `.cast(F32)` compute in three launches); without `wide` only `yh` (`None` for `y`),
/// for a float16 matrix product that reads it as it is.
///
/// Panics on a dtype other than float32.
pub fn half_forward_launch<R: CubeRuntime>(
    activation: Activation,
    x: CubeTensor<R>,
    wide: bool,
) -> (Option<CubeTensor<R>>, CubeTensor<R>) {
    assert_eq!(x.dtype, DType::F32, "activation kernel: float32 input");
    let x = into_contiguous(x);
    let (client, device) = (x.client.clone(), x.device.clone());
    // Without `wide` no thread writes `y`: one value stands in for it.
    let y_shape = if wide { x.shape() } else { Shape::new([1]) };
    let y = empty_device::<R, f32>(client.clone(), device.clone(), y_shape);
    let yh = empty_device::<R, f16>(client.clone(), device, x.shape());
    let (n, count, dim) = grid(&x);
    half_forward::launch::<R>(
        &client,
        count,
        dim,
        x.into_array_arg(),
        y.clone().into_array_arg(),
        yh.clone().into_array_arg(),
        n,
        u32::from(activation == Activation::Elu),
        u32::from(wide),
    );
    (wide.then_some(y), yh)
}

/// The gradient of [`half_forward_launch`] from its float16 output `yh` and the incoming
/// gradient `grad` (float32, or float16), computed in float16 and returned in float32 (or,
/// with `narrow`, in float16: what a float16 matrix product's backward step reads), in one
/// launch.
///
/// Panics on other dtypes or shapes that differ.
pub fn half_backward_launch<R: CubeRuntime>(
    activation: Activation,
    yh: CubeTensor<R>,
    grad: CubeTensor<R>,
    narrow: bool,
) -> CubeTensor<R> {
    assert!(
        yh.dtype == DType::F16 && matches!(grad.dtype, DType::F32 | DType::F16),
        "activation kernel: a float16 output and a float32 or float16 gradient ({:?}, {:?})",
        yh.dtype,
        grad.dtype
    );
    assert_eq!(yh.shape(), grad.shape(), "activation kernel: shapes differ");
    let (yh, grad) = (into_contiguous(yh), into_contiguous(grad));
    let client = yh.client.clone();
    let dx = if narrow {
        empty_device::<R, f16>(client.clone(), yh.device.clone(), yh.shape())
    } else {
        empty_device::<R, f32>(client.clone(), yh.device.clone(), yh.shape())
    };
    let (n, count, dim) = grid(&yh);
    let launch = match (grad.dtype == DType::F16, narrow) {
        (false, false) => half_backward::launch::<f32, f32, R>,
        (false, true) => half_backward::launch::<f32, f16, R>,
        (true, false) => half_backward::launch::<f16, f32, R>,
        (true, true) => half_backward::launch::<f16, f16, R>,
    };
    launch(
        &client,
        count,
        dim,
        yh.into_array_arg(),
        grad.into_array_arg(),
        dx.clone().into_array_arg(),
        n,
        u32::from(activation == Activation::Elu),
    );
    dx
}
