//! ELU and the logistic sigmoid, forward and backward, as one GPU kernel each for burn's
//! CubeCL backends (wgpu, CUDA), float32: where the composed burn operations launch five
//! kernels for ELU's forward pass (a comparison, a clamp, `exp`, a subtraction, a masked
//! select) and four for its backward pass, and four each way for the sigmoid.
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
//! A tensor of another dtype (float16 under mixed precision) keeps the composed forms.

use burn::tensor::{DType, TensorMetadata};
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
pub(crate) fn elu_value(v: f32) -> f32 {
    let mut out = v;
    if v <= 0.0 {
        out = f32::exp(v) - 1.0;
        // Near 0, `e^x - 1` cancels (x = -1e-7 gives -1.19e-7): the Taylor series to x^8
        // (truncation below 3e-7 relative for -1/2 < x <= 0).
        // Coefficients 1/k! for k = 2..8.
        if v > -0.5 {
            let p8 = v * 2.480_158_7e-5 + 1.984_127e-4;
            let p7 = v * p8 + 1.388_888_9e-3;
            let p6 = v * p7 + 8.333_334e-3;
            let p5 = v * p6 + 4.166_666_8e-2;
            let p4 = v * p5 + 0.166_666_67;
            let p3 = v * p4 + 0.5;
            out = v * (v * p3 + 1.0);
        }
    }
    out
}

/// `y[i] = elu(x[i])` for `i < n`.
#[cube(launch)]
fn elu_forward(x: &Array<f32>, y: &mut Array<f32>, n: u32) {
    let i = ABSOLUTE_POS as u32;
    if i >= n {
        terminate!();
    }
    y[i as usize] = elu_value(x[i as usize]);
}

/// `dx[i] = g[i]` where `y[i] > 0`, else `g[i] (y[i] + 1)`, for `i < n`.
#[cube(launch)]
fn elu_backward(y: &Array<f32>, g: &Array<f32>, dx: &mut Array<f32>, n: u32) {
    let i = ABSOLUTE_POS as u32;
    if i >= n {
        terminate!();
    }
    let yi = y[i as usize];
    let mut d = yi + 1.0;
    if yi > 0.0 {
        d = 1.0;
    }
    dx[i as usize] = g[i as usize] * d;
}

/// `s[i] = 1 / (1 + exp(-x[i]))` for `i < n`.
#[cube(launch)]
fn sigmoid_forward(x: &Array<f32>, s: &mut Array<f32>, n: u32) {
    let i = ABSOLUTE_POS as u32;
    if i >= n {
        terminate!();
    }
    s[i as usize] = 1.0 / (f32::exp(-x[i as usize]) + 1.0);
}

/// `dx[i] = (g[i] s[i]) (1 - s[i])` for `i < n`.
#[cube(launch)]
fn sigmoid_backward(s: &Array<f32>, g: &Array<f32>, dx: &mut Array<f32>, n: u32) {
    let i = ABSOLUTE_POS as u32;
    if i >= n {
        terminate!();
    }
    let si = s[i as usize];
    dx[i as usize] = g[i as usize] * si * (1.0 - si);
}

/// Whether the kernels take `t` (float32; any shape, made contiguous first).
pub fn supports<R: CubeRuntime>(t: &CubeTensor<R>) -> bool {
    t.dtype == DType::F32
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

/// The activation of `x` (float32, any shape), elementwise, in one launch: a new tensor of
/// `x`'s shape.
///
/// Panics on a dtype other than float32 ([`supports`]).
pub fn forward<R: CubeRuntime>(activation: Activation, x: CubeTensor<R>) -> CubeTensor<R> {
    assert!(
        supports(&x),
        "activation kernel: float32 only ({:?})",
        x.dtype
    );
    let x = into_contiguous(x);
    let client = x.client.clone();
    let out = empty_device::<R, f32>(client.clone(), x.device.clone(), x.shape());
    let (n, count, dim) = grid(&x);
    let (input, output) = (x.into_array_arg(), out.clone().into_array_arg());
    match activation {
        Activation::Elu => elu_forward::launch::<R>(&client, count, dim, input, output, n),
        Activation::Sigmoid => sigmoid_forward::launch::<R>(&client, count, dim, input, output, n),
    }
    out
}

/// The gradient of [`forward`] from its output `y` and the incoming gradient `grad` (both
/// float32, the same shape), in one launch.
///
/// Panics on a dtype other than float32 or shapes that differ.
pub fn backward<R: CubeRuntime>(
    activation: Activation,
    y: CubeTensor<R>,
    grad: CubeTensor<R>,
) -> CubeTensor<R> {
    assert!(
        supports(&y) && supports(&grad),
        "activation kernel: float32 only ({:?}, {:?})",
        y.dtype,
        grad.dtype
    );
    assert_eq!(y.shape(), grad.shape(), "activation kernel: shapes differ");
    let (y, grad) = (into_contiguous(y), into_contiguous(grad));
    let client = y.client.clone();
    let dx = empty_device::<R, f32>(client.clone(), y.device.clone(), y.shape());
    let (n, count, dim) = grid(&y);
    let (ya, ga, da) = (
        y.into_array_arg(),
        grad.into_array_arg(),
        dx.clone().into_array_arg(),
    );
    match activation {
        Activation::Elu => elu_backward::launch::<R>(&client, count, dim, ya, ga, da, n),
        Activation::Sigmoid => sigmoid_backward::launch::<R>(&client, count, dim, ya, ga, da, n),
    }
    dx
}
