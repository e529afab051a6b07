//! The fused GPU kernels against burn's autodiff of their composed forms: one forward and
//! one backward pass of a kernel (or of the composed form, on the CPU engines) for a loss
//! `L = Σ a y` (plus `Σ c ·` of a second output), returning the outputs and the gradient of
//! every input as f64 values, for a test or an adapter check to compare with stated
//! tolerances.
//!
//! These are non-generic entries on purpose: a release build shares no generic
//! instantiations between crates, so a test binary that named `Autodiff<Wgpu>` and
//! `Autodiff<NdArray<f64>>` itself compiled burn's autodiff, its CubeCL kernels and every
//! fused operation again (about 3 minutes of every `make test` on 2 cores); here they are
//! compiled once, with the model's.

use crate::device::{WgpuAutodiff, WgpuBackend};
use crate::fused_ops::{FusedOps, Precision};
use crate::spline::SplineParams;
use burn::backend::wgpu::WgpuDevice;
use burn::backend::{Autodiff, NdArray};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{DType, FloatDType, Tensor, TensorData};

/// Where and in which float type a check evaluates.
#[derive(Debug, Clone, Copy)]
pub enum Engine<'a> {
    /// burn's wgpu backend on `device`, in float32, or in float16 (`half`: float16 tensors
    /// throughout).
    Gpu {
        /// The adapter's device.
        device: &'a WgpuDevice,
        /// Float16 tensors instead of float32.
        half: bool,
    },
    /// burn's ndarray backend in f64: the reference.
    CpuF64,
    /// burn's ndarray backend in float32 (the composed forms the CPU engine runs).
    CpuF32,
}

/// Runs `$f::<B>(device, dtype, ...)` on the backend and dtype of `$engine`.
macro_rules! on_engine {
    ($engine:expr, $f:ident ( $($arg:expr),* )) => {
        match $engine {
            Engine::Gpu { device, half } => {
                let dtype = if half { FloatDType::F16 } else { FloatDType::F32 };
                $f::<WgpuAutodiff>(device, dtype, $($arg),*)
            }
            Engine::CpuF64 => {
                $f::<Autodiff<NdArray<f64>>>(&Default::default(), FloatDType::F64, $($arg),*)
            }
            Engine::CpuF32 => {
                $f::<Autodiff<NdArray<f32>>>(&Default::default(), FloatDType::F32, $($arg),*)
            }
        }
    };
}

fn f64s(d: TensorData) -> Vec<f64> {
    d.convert::<f64>()
        .to_vec()
        .expect("a float tensor converts to f64")
}

fn matrix<B: AutodiffBackend>(
    v: &[f32],
    shape: [usize; 2],
    device: &B::Device,
    dtype: FloatDType,
) -> Tensor<B, 2> {
    // burn keeps one default float dtype per device kind (NdArray<f32> and NdArray<f64>
    // share theirs), so the dtype is set explicitly.
    Tensor::<B, 2>::from_data(TensorData::new(v.to_vec(), shape), device).cast(dtype)
}

fn vector<B: AutodiffBackend>(v: &[f32], device: &B::Device, dtype: FloatDType) -> Tensor<B, 1> {
    Tensor::<B, 1>::from_data(TensorData::new(v.to_vec(), [v.len()]), device).cast(dtype)
}

fn activation_on<B: AutodiffBackend + FusedOps>(
    device: &B::Device,
    dtype: FloatDType,
    sigmoid: bool,
    x: &[f32],
    a: &[f32],
    rows: usize,
) -> (Vec<f64>, Vec<f64>) {
    let shape = [rows, x.len() / rows];
    let xt = matrix::<B>(x, shape, device, dtype).require_grad();
    let y = if sigmoid {
        B::fused_sigmoid(xt.clone())
    } else {
        B::fused_elu(xt.clone())
    };
    let grads = (y.clone() * matrix::<B>(a, shape, device, dtype))
        .sum()
        .backward();
    let dx = xt.grad(&grads).expect("x has a gradient");
    (f64s(y.into_data()), f64s(dx.into_data()))
}

/// ELU (or the sigmoid, `sigmoid`) of `x: [rows, cols]` (row-major) and `dL/dx` for
/// `L = Σ a y` ([`FusedOps::fused_elu`], [`FusedOps::fused_sigmoid`]): `(y, dL/dx)`, each
/// `[rows * cols]`.
///
/// Panics when no adapter computes on `engine` or the lengths disagree.
pub fn activation(
    engine: Engine<'_>,
    sigmoid: bool,
    x: &[f32],
    a: &[f32],
    rows: usize,
) -> (Vec<f64>, Vec<f64>) {
    on_engine!(engine, activation_on(sigmoid, x, a, rows))
}

/// Mixed precision's activation path on the GPU ([`FusedOps::elu_at`],
/// [`FusedOps::sigmoid_at`] with [`Precision::Half`]): float32 in, the cast to float16
/// inside the kernels, the sigmoid's output float32 and the ELU's float16 (what the next
/// linear layer's float16 product reads); `(y, dL/dx)` as for [`activation`].
///
/// Panics when the output's dtype is not that or the lengths disagree.
pub fn activation_mixed(
    device: &WgpuDevice,
    sigmoid: bool,
    x: &[f32],
    a: &[f32],
    rows: usize,
) -> (Vec<f64>, Vec<f64>) {
    let shape = [rows, x.len() / rows];
    let t = |v: &[f32]| {
        Tensor::<WgpuAutodiff, 2>::from_data(TensorData::new(v.to_vec(), shape), device)
    };
    let xt = t(x).require_grad();
    let y = if sigmoid {
        WgpuAutodiff::sigmoid_at(xt.clone(), Precision::Half)
    } else {
        WgpuAutodiff::elu_at(xt.clone(), Precision::Half)
    };
    let want = if sigmoid { DType::F32 } else { DType::F16 };
    assert_eq!(
        y.dtype(),
        want,
        "mixed precision's sigmoid returns float32, its ELU float16"
    );
    // The loss in float32 (its gradient reaches a float16 output through the cast).
    let grads = (y.clone().cast(FloatDType::F32) * t(a)).sum().backward();
    let dx = xt.grad(&grads).expect("x has a gradient");
    (f64s(y.into_data()), f64s(dx.into_data()))
}

/// At [`Precision::Half`], `w`'s float16 copy outside the autodiff graph, as a training
/// pass hands it over ([`crate::params::Params::weight_f16`]); else `None`.
fn half_copy<B: AutodiffBackend + FusedOps>(
    w: &Tensor<B, 1>,
    precision: Precision,
) -> Option<Tensor<B, 1>> {
    (precision == Precision::Half)
        .then(|| Tensor::from_inner(w.clone().inner().cast(FloatDType::F16)))
}

fn linear_on<B: AutodiffBackend + FusedOps>(
    device: &B::Device,
    dtype: FloatDType,
    precision: Precision,
    x: &[f32],
    rows: usize,
    wb: (&[f32], &[f32]),
    a: &[f32],
) -> Vec<Vec<f64>> {
    let (w, b) = wb;
    let xt = matrix::<B>(x, [rows, x.len() / rows], device, dtype).require_grad();
    let wt = vector::<B>(w, device, dtype).require_grad();
    let bt = vector::<B>(b, device, dtype).require_grad();
    let y = B::linear_at(
        xt.clone(),
        wt.clone(),
        half_copy(&wt, precision),
        bt.clone(),
        precision,
    );
    let at = matrix::<B>(a, y.dims(), device, dtype);
    let grads = (y.clone() * at).sum().backward();
    vec![
        f64s(y.into_data()),
        f64s(xt.grad(&grads).expect("x's gradient").into_data()),
        f64s(wt.grad(&grads).expect("W's gradient").into_data()),
        f64s(bt.grad(&grads).expect("b's gradient").into_data()),
    ]
}

/// A linear layer `y = x Wᵀ + b` ([`FusedOps::linear_at`] in float32, or in the engine's
/// float16) for `x: [rows, k]`, `w` flat `[f * k]`, `b: [f]`: `[y [rows * f], dL/dx, dL/dW,
/// dL/db]` for `L = Σ a y`.
pub fn linear(
    engine: Engine<'_>,
    x: &[f32],
    rows: usize,
    w: &[f32],
    b: &[f32],
    a: &[f32],
) -> Vec<Vec<f64>> {
    on_engine!(engine, linear_on(Precision::F32, x, rows, (w, b), a))
}

/// Mixed precision's linear layer on the GPU ([`FusedOps::linear_at`] with
/// [`Precision::Half`]: float32 in and out, the products in float16, the bias and the casts
/// inside [`crate::linear_half_kernel`]'s kernels); results as for [`linear`].
pub fn linear_mixed(
    device: &WgpuDevice,
    x: &[f32],
    rows: usize,
    w: &[f32],
    b: &[f32],
    a: &[f32],
) -> Vec<Vec<f64>> {
    linear_on::<WgpuAutodiff>(device, FloatDType::F32, Precision::Half, x, rows, (w, b), a)
}

/// Which layer kernel [`layer`] runs ([`FusedOps::LAYER_KERNELS`]).
#[derive(Debug, Clone, Copy)]
pub enum Layer {
    /// LayerNorm (eps 1e-5), then ELU when true; inputs `x [rows, f]`, `weight [f]`,
    /// `bias [f]`.
    Norm(bool),
    /// `elu(x Wᵀ + b)`; inputs `x [rows, k]`, `W` flat `[f * k]`, `b [f]`.
    LinearElu,
    /// The same as two operations, [`FusedOps::linear_at`] then [`FusedOps::elu_at`]
    /// (what [`Layer::LinearElu`]'s kernel replaces), the weight cast by the layer itself.
    LinearThenElu,
    /// The gated residual tail `x + (t W₁ᵀ + b₁) sigmoid(context W_cᵀ + b_c)`; inputs
    /// `x [rows, f]`, `t [rows, f]`, `W₁ [f * f]`, `b₁ [f]`, `context [rows, k]`,
    /// `W_c [f * k]`, `b_c [f]`.
    Gated,
    /// A residual block's end `x + (t Wᵀ + b)`; inputs `x [rows, f]`, `t [rows, k]`,
    /// `W [f * k]`, `b [f]`.
    Residual,
}

fn layer_on<B: AutodiffBackend + FusedOps>(
    device: &B::Device,
    dtype: FloatDType,
    precision: Precision,
    layer: Layer,
    inputs: &[(Vec<f32>, Vec<usize>)],
    a: &[f32],
) -> Vec<Vec<f64>> {
    let m = |i: usize| {
        let (v, s) = &inputs[i];
        matrix::<B>(v, [s[0], s[1]], device, dtype).require_grad()
    };
    let v = |i: usize| vector::<B>(&inputs[i].0, device, dtype).require_grad();
    let (y, mats, vecs) = match layer {
        Layer::Norm(elu) => {
            let (x, w, b) = (m(0), v(1), v(2));
            let y = B::fused_layer_norm(x.clone(), w.clone(), b.clone(), 1e-5, elu);
            (y, vec![x], vec![w, b])
        }
        Layer::LinearElu => {
            let (x, w, b) = (m(0), v(1), v(2));
            let w16 = half_copy(&w, precision);
            let y = B::linear_elu_at(x.clone(), w.clone(), w16, b.clone(), precision);
            (y, vec![x], vec![w, b])
        }
        Layer::LinearThenElu => {
            let (x, w, b) = (m(0), v(1), v(2));
            let z = B::linear_at(x.clone(), w.clone(), None, b.clone(), precision);
            (B::elu_at(z, precision), vec![x], vec![w, b])
        }
        Layer::Gated => {
            let (x, t, w1, b1, c, wc, bc) = (m(0), m(1), v(2), v(3), m(4), v(5), v(6));
            // Mixed precision's blocks hand `t` over in float16 (an ELU's output).
            let t_in = match precision {
                Precision::Half => t.clone().cast(FloatDType::F16),
                Precision::F32 => t.clone(),
            };
            let y = B::gated_residual(
                x.clone(),
                t_in,
                w1.clone(),
                half_copy(&w1, precision),
                b1.clone(),
                c.clone(),
                wc.clone(),
                bc.clone(),
                precision,
            );
            (y, vec![x, t, c], vec![w1, b1, wc, bc])
        }
        Layer::Residual => {
            let (x, t, w, b) = (m(0), m(1), v(2), v(3));
            let y = B::linear_residual(x.clone(), t.clone(), w.clone(), b.clone());
            (y, vec![x, t], vec![w, b])
        }
    };
    let at = matrix::<B>(a, y.dims(), device, dtype);
    // A float16 output (mixed precision's linear layer with its ELU) meets the loss in the
    // engine's dtype; its gradient comes back through the cast.
    let grads = (y.clone().cast(dtype) * at).sum().backward();
    let mut out = vec![f64s(y.into_data())];
    let missing = "an input's gradient";
    out.extend(
        mats.iter()
            .map(|t| f64s(t.grad(&grads).expect(missing).into_data())),
    );
    out.extend(
        vecs.iter()
            .map(|t| f64s(t.grad(&grads).expect(missing).into_data())),
    );
    out
}

/// A layer kernel's output and every input's gradient for `L = Σ a y`: `[y, then the
/// gradients of the matrix inputs, then of the vector inputs]` in [`Layer`]'s argument
/// order; `inputs` are `(values, shape)` (a 1-element shape for a vector).
///
/// Panics on shapes that disagree with the values or with the layer.
pub fn layer(
    engine: Engine<'_>,
    layer: Layer,
    inputs: &[(Vec<f32>, Vec<usize>)],
    a: &[f32],
) -> Vec<Vec<f64>> {
    on_engine!(engine, layer_on(Precision::F32, layer, inputs, a))
}

/// [`layer`] in mixed precision on the GPU ([`Precision::Half`]: for [`Layer::Gated`] the
/// block's product in float16 on `t` handed over in float16, the gate and the tail in the
/// float32 kernel; for [`Layer::LinearElu`] the product, bias and ELU in float16, the output
/// float16), each weight's float16 copy handed over as a training pass does; float32 in.
pub fn layer_mixed(
    device: &WgpuDevice,
    layer: Layer,
    inputs: &[(Vec<f32>, Vec<usize>)],
    a: &[f32],
) -> Vec<Vec<f64>> {
    layer_on::<WgpuAutodiff>(device, FloatDType::F32, Precision::Half, layer, inputs, a)
}

/// LayerNorm (then ELU when `elu`) on the GPU without autodiff (evaluation passes):
/// `x: [rows, f]`, `weight`, `bias: [f]` -> `y [rows * f]`.
pub fn layer_norm_inference(
    device: &WgpuDevice,
    x: &[f32],
    rows: usize,
    weight: &[f32],
    bias: &[f32],
    elu: bool,
) -> Vec<f64> {
    let t = Tensor::<WgpuBackend, 2>::from_data(
        TensorData::new(x.to_vec(), [rows, x.len() / rows]),
        device,
    );
    let v = |v: &[f32]| {
        Tensor::<WgpuBackend, 1>::from_data(TensorData::new(v.to_vec(), [v.len()]), device)
    };
    f64s(WgpuBackend::fused_layer_norm(t, v(weight), v(bias), 1e-5, elu).into_data())
}

fn lu_on<B: AutodiffBackend + FusedOps>(
    device: &B::Device,
    dtype: FloatDType,
    params: [&[f32]; 4],
    perm: Option<&[usize]>,
    a: &[f32],
) -> Vec<Vec<f64>> {
    let [lower, upper, diag, bias] = params.map(|p| vector::<B>(p, device, dtype).require_grad());
    let w = diag.dims()[0] + 2;
    let m = B::lu_affine(
        lower.clone(),
        upper.clone(),
        diag.clone(),
        bias.clone(),
        1e-3,
        perm,
    );
    let grads = (m.clone() * matrix::<B>(a, [w, w], device, dtype))
        .sum()
        .backward();
    let mut out = vec![f64s(m.into_data())];
    for t in [&lower, &upper, &diag, &bias] {
        // An empty parameter (n = 1's strict triangles) may get no gradient node.
        out.push(match t.grad(&grads) {
            Some(g) => f64s(g.into_data()),
            None if t.dims()[0] == 0 => Vec::new(),
            None => panic!("an input's gradient"),
        });
    }
    out
}

/// A flow step's LU map on the flow state ([`FusedOps::lu_affine`], eps 1e-3) for
/// `params = [lower, upper ([n(n-1)/2] each), unconstrained diagonal [n], bias [n]]` and the
/// step's permutation `perm` (the weight's rows permuted, `A[perm[j], i] = W_ij`):
/// `[A [(n + 2)²], dL/dlower, dL/dupper, dL/ddiag, dL/dbias]` for `L = Σ a A`.
pub fn lu(
    engine: Engine<'_>,
    params: [&[f32]; 4],
    perm: Option<&[usize]>,
    a: &[f32],
) -> Vec<Vec<f64>> {
    on_engine!(engine, lu_on(params, perm, a))
}

/// The shape of a [`coupling`] check: `rows`, features `d` (the state is `[rows, d + 2]`),
/// context features `c`, and the first transformed feature `start` (0 or 1: the alternating
/// masks).
#[derive(Debug, Clone, Copy)]
pub struct CouplingShape {
    /// Samples.
    pub rows: usize,
    /// Features.
    pub d: usize,
    /// Context features.
    pub c: usize,
    /// The first transformed feature.
    pub start: usize,
}

impl CouplingShape {
    /// The transformed features `t`.
    pub fn transformed(&self) -> usize {
        crate::coupling_kernel::transformed_count(self.d + 2, self.start)
    }
}

/// The inputs of a [`coupling`] check and its loss weights, row-major.
#[derive(Debug, Clone)]
pub struct CouplingCase {
    /// The shape.
    pub shape: CouplingShape,
    /// The flow state `[rows, d + 2]`.
    pub state: Vec<f32>,
    /// The context `[rows, c]`.
    pub ctx: Vec<f32>,
    /// The spline's output `[rows t, 2]`.
    pub both: Vec<f32>,
    /// Weights of the conditioner's input `[rows, (d - t) + c]` in the loss.
    pub a_split: Vec<f32>,
    /// Weights of the next state `[rows, d + 2]` in the loss.
    pub a_place: Vec<f32>,
}

fn coupling_on<B: AutodiffBackend + FusedOps>(
    device: &B::Device,
    dtype: FloatDType,
    case: &CouplingCase,
) -> Vec<Vec<f64>> {
    let CouplingShape { rows, d, c, start } = case.shape;
    let t = case.shape.transformed();
    let st = matrix::<B>(&case.state, [rows, d + 2], device, dtype).require_grad();
    let ct = matrix::<B>(&case.ctx, [rows, c], device, dtype).require_grad();
    let bt = matrix::<B>(&case.both, [rows * t, 2], device, dtype).require_grad();
    let input = B::coupling_split(st.clone(), ct.clone(), start);
    let next = B::coupling_place(st.clone(), bt.clone(), start);
    let a1 = matrix::<B>(&case.a_split, [rows, d - t + c], device, dtype);
    let a2 = matrix::<B>(&case.a_place, [rows, d + 2], device, dtype);
    let grads = ((input.clone() * a1).sum() + (next.clone() * a2).sum()).backward();
    vec![
        f64s(input.into_data()),
        f64s(next.into_data()),
        f64s(st.grad(&grads).expect("the state's gradient").into_data()),
        f64s(ct.grad(&grads).expect("the context's gradient").into_data()),
        f64s(bt.grad(&grads).expect("the spline's gradient").into_data()),
    ]
}

/// A coupling step's input and end on the flow state ([`FusedOps::coupling_split`],
/// [`FusedOps::coupling_place`]) for `case`: `[input [rows ((d - t) + c)], next state
/// [rows (d + 2)], dL/dstate, dL/dctx, dL/dboth]` for `L = Σ a_split input + Σ a_place
/// next`.
pub fn coupling(engine: Engine<'_>, case: &CouplingCase) -> Vec<Vec<f64>> {
    on_engine!(engine, coupling_on(case))
}

fn base_on<B: AutodiffBackend + FusedOps>(
    device: &B::Device,
    dtype: FloatDType,
    state: &[f32],
    a: &[f32],
    constants: (f64, f64),
) -> Vec<Vec<f64>> {
    let rows = a.len();
    let st = matrix::<B>(state, [rows, state.len() / rows], device, dtype).require_grad();
    let lp = B::base_log_prob(st.clone(), constants.0, constants.1);
    let grads = (lp.clone() * vector::<B>(a, device, dtype))
        .sum()
        .backward();
    vec![
        f64s(lp.into_data()),
        f64s(st.grad(&grads).expect("the state's gradient").into_data()),
    ]
}

/// The flow's base log-density with its log-determinant ([`FusedOps::base_log_prob`]) for
/// the flow state `state: [rows, d + 2]` (row-major; `rows = a.len()`) and the constants
/// `(c, jac)`: `[lp [rows], dL/dstate [rows (d + 2)]]` for `L = Σ a lp`.
pub fn base_log_prob(
    engine: Engine<'_>,
    state: &[f32],
    a: &[f32],
    constants: (f64, f64),
) -> Vec<Vec<f64>> {
    on_engine!(engine, base_on(state, a, constants))
}

/// The inputs of a [`spline`] check: `x: [M]`, `raw: [M, 3K-1]` (row-major), the loss
/// weights `a`, `b` (`[M]` each), the width/height scale and the spline.
#[derive(Debug, Clone)]
pub struct SplineCase {
    /// Inputs `[M]`.
    pub x: Vec<f32>,
    /// Raw bin parameters `[M, 3K-1]`.
    pub raw: Vec<f32>,
    /// Weights of `y` in the loss `[M]`.
    pub a: Vec<f32>,
    /// Weights of `log|dy/dx|` in the loss `[M]`.
    pub b: Vec<f32>,
    /// Scale of the width and height logits (`1/sqrt(hidden)`).
    pub scale: f64,
    /// Bins and tail bound.
    pub sp: SplineParams,
}

/// A spline check's results: `y`, `log|dy/dx|`, `dL/dx` (`[M]` each) and `dL/draw`
/// (`[M * (3K-1)]`) for `L = Σ a y + Σ b log|dy/dx|`.
#[derive(Debug, Clone)]
pub struct SplineEval {
    /// Outputs.
    pub y: Vec<f64>,
    /// Log-derivatives.
    pub ld: Vec<f64>,
    /// Gradient with respect to the inputs.
    pub gx: Vec<f64>,
    /// Gradient with respect to the raw parameters.
    pub graw: Vec<f64>,
}

fn spline_on<B: AutodiffBackend + FusedOps>(
    device: &B::Device,
    dtype: FloatDType,
    c: &SplineCase,
) -> SplineEval {
    let m = c.x.len();
    let width = c.raw.len() / m;
    let xt = matrix::<B>(&c.x, [m, 1], device, dtype).require_grad();
    let rt = matrix::<B>(&c.raw, [m, width], device, dtype).require_grad();
    let (y, ld) = B::spline(xt.clone(), rt.clone(), c.scale, &c.sp);
    let loss = (y.clone() * matrix::<B>(&c.a, [m, 1], device, dtype)).sum()
        + (ld.clone() * matrix::<B>(&c.b, [m, 1], device, dtype)).sum();
    let grads = loss.backward();
    SplineEval {
        y: f64s(y.into_data()),
        ld: f64s(ld.into_data()),
        gx: f64s(xt.grad(&grads).expect("x's gradient").into_data()),
        graw: f64s(rt.grad(&grads).expect("raw's gradient").into_data()),
    }
}

fn spline_state_on<B: AutodiffBackend + FusedOps>(
    device: &B::Device,
    dtype: FloatDType,
    c: &SplineCase,
    rows: usize,
    start: usize,
    bias: Option<&[f32]>,
) -> (SplineEval, Option<Vec<f64>>) {
    let w = c.x.len() / rows;
    let m = c.a.len();
    let width = c.raw.len() / m;
    let st = matrix::<B>(&c.x, [rows, w], device, dtype).require_grad();
    let rt = matrix::<B>(&c.raw, [m, width], device, dtype).require_grad();
    let bt = bias.map(|b| vector::<B>(b, device, dtype).require_grad());
    let both = B::spline_joint(
        st.clone(),
        rt.clone(),
        c.scale,
        &c.sp,
        Some(start),
        bt.clone(),
    );
    let y = both.clone().slice([0..m, 0..1]);
    let ld = both.slice([0..m, 1..2]);
    let loss = (y.clone() * matrix::<B>(&c.a, [m, 1], device, dtype)).sum()
        + (ld.clone() * matrix::<B>(&c.b, [m, 1], device, dtype)).sum();
    let grads = loss.backward();
    let gbias = bt.map(|b| f64s(b.grad(&grads).expect("the bias's gradient").into_data()));
    let eval = SplineEval {
        y: f64s(y.into_data()),
        ld: f64s(ld.into_data()),
        gx: f64s(st.grad(&grads).expect("the state's gradient").into_data()),
        graw: f64s(rt.grad(&grads).expect("raw's gradient").into_data()),
    };
    (eval, gbias)
}

/// The coupling spline reading its inputs from the flow state ([`FusedOps::spline_joint`]
/// with a mask `start`): `case.x` is the state `[rows, d + 2]`, `case.raw`, `case.a` and
/// `case.b` have the `M = rows t` rows of the transformed features; `gx` is the state's
/// gradient `[rows (d + 2)]`. With `bias` (`[t (3K-1)]`, the conditioner's final layer's)
/// `case.raw` is the product without it, and the bias's gradient comes second.
pub fn spline_on_state(
    engine: Engine<'_>,
    case: &SplineCase,
    rows: usize,
    start: usize,
    bias: Option<&[f32]>,
) -> (SplineEval, Option<Vec<f64>>) {
    on_engine!(engine, spline_state_on(case, rows, start, bias))
}

/// The coupling spline ([`FusedOps::spline`]: the GPU's kernels, the composed form on the
/// CPU) and its gradients for `case`.
pub fn spline(engine: Engine<'_>, case: &SplineCase) -> SplineEval {
    on_engine!(engine, spline_on(case))
}

/// The spline's forward kernel on the GPU without autodiff (evaluation passes):
/// `(y, log|dy/dx|)`, `[M]` each.
pub fn spline_inference(device: &WgpuDevice, case: &SplineCase) -> (Vec<f64>, Vec<f64>) {
    let m = case.x.len();
    let width = case.raw.len() / m;
    let (y, ld) = <WgpuBackend as FusedOps>::spline(
        Tensor::from_data(TensorData::new(case.x.clone(), [m, 1]), device),
        Tensor::from_data(TensorData::new(case.raw.clone(), [m, width]), device),
        case.scale,
        &case.sp,
    );
    (f64s(y.into_data()), f64s(ld.into_data()))
}

/// Whether the GPU backend runs the layer kernels and the spline kernel, and the float32
/// CPU backend the composed forms ([`FusedOps::LAYER_KERNELS`], [`FusedOps::SPLINE_KERNEL`]):
/// `(gpu layer kernels, gpu spline kernel, cpu f64 layer kernels, cpu f32 spline kernel)`.
pub fn kernel_flags() -> (bool, bool, bool, bool) {
    (
        <WgpuAutodiff as FusedOps>::LAYER_KERNELS,
        <WgpuAutodiff as FusedOps>::SPLINE_KERNEL,
        <Autodiff<NdArray<f64>> as FusedOps>::LAYER_KERNELS,
        <Autodiff<NdArray<f32>> as FusedOps>::SPLINE_KERNEL,
    )
}
