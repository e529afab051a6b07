//! Single autodiff operations for the layers the NPE network spends its time in: the linear
//! layer, ELU and the logistic sigmoid ([`FusedOps`]).
//!
//! burn composes a linear layer from a reshape, a transpose, a matrix product (whose ndarray
//! kernel copies a transposed operand into a contiguous one, in the forward and the backward
//! pass) and a broadcast addition; `elu` from five tensor operations (`exp` over the whole
//! input, then a subtraction, a scaling and a `mask_where` whose backward builds zero
//! tensors); and `sigmoid` as `exp(-log(1 + exp(-x)))`, whose backward recomputes the
//! exponentials. Here each is one operation with its own backward step:
//!
//! - linear (PyTorch `nn.Linear`): `y = x Wᵀ + b`; `dx = g W`, `dW = gᵀ x`, `db = Σ_batch g`,
//!   each computed only when that input needs a gradient (frozen weights, data inputs);
//! - ELU (α = 1; Clevert, Unterthiner, Hochreiter 2016): `y = x` for `x > 0`, `e^x - 1`
//!   otherwise; `dy/dx = 1` for `y > 0`, `y + 1` otherwise (from the saved output);
//! - sigmoid: `s = 1 / (1 + e^-x)`; `ds/dx = s (1 - s)` (from the saved output).
//!
//! On the ndarray backend (f32) the matrix products call `matrixmultiply`'s sgemm (through
//! `ndarray::linalg::general_mat_mul`, as burn does) on strided views, without copies, with
//! the bias as the initial output; the activations are one pass over the data with
//! [`exp_f32`], a branch-free exponential (Cephes `expf`'s range reduction and polynomial,
//! Moshier 1989) that the compiler vectorizes; it uses only IEEE additions and
//! multiplications (no fused multiply-add), so every CPU computes the same bits. On burn's
//! GPU backends (wgpu, CUDA) ELU and the sigmoid are one kernel forward and one backward
//! each in float32 and float16 ([`crate::activation_kernel`]); the linear layer and the f64
//! backend compose the same formulas from burn's tensor operations.
//!
//! The coupling spline ([`FusedOps::spline`], the density direction that training and
//! log-probabilities run) is one operation on burn's GPU backends: a forward and a backward
//! kernel ([`crate::spline_kernel`]), where the composed operations launch about 240 small
//! kernels per coupling and step. The CPU backends compose it (there a launch costs nothing).
//!
//! On the GPU backends ([`FusedOps::LAYER_KERNELS`]) the layers also call single operations
//! of one kernel each way, float32 (but for mixed precision's float16 forms): LayerNorm with
//! the ELU after it ([`FusedOps::fused_layer_norm`]), the bias and ELU after a product
//! ([`FusedOps::linear_elu_at`]), the gated residual block's tail
//! ([`FusedOps::gated_residual`]; [`crate::layer_kernel`]). The flow runs on one state
//! tensor `[N, n + 2]` (features, log-determinant, ones): each step's LU map as one matrix
//! ([`FusedOps::lu_affine`]; [`crate::lu_kernel`]) and one product, the coupling's input and
//! end ([`FusedOps::coupling_split`], [`FusedOps::coupling_place`]) and the base density
//! ([`FusedOps::base_log_prob`]; [`crate::coupling_kernel`]). Their backward kernels sum
//! the bias and scale gradients over the batch in the same launch. The default methods
//! compose burn's operations (the CPU backends never call them: the layers keep their
//! composed code there, so CPU results are unchanged).

use crate::activation_kernel::Activation;
use crate::spline::SplineParams;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::ndarray::{NdArray, NdArrayTensor};
use burn::backend::Autodiff;
use burn::tensor::activation::softplus;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor, TensorPrimitive};
use ndarray::{linalg::general_mat_mul, Array2, ArrayView1, ArrayView2, Axis, Ix1, Ix2};

/// Registers each present gradient `d` (an inner-backend tensor) for its tracked parent `p`
/// in a backward step: `register!(grads; (p, d), ...)` with `p: Option<parent>`,
/// `d: Option<Tensor<B, D>>`.
macro_rules! register {
    ($grads:expr; $(($p:expr, $d:expr)),+ $(,)?) => {
        $(
            if let (Some(p), Some(d)) = ($p, $d) {
                $grads.register::<B>(p.id, prim(d));
            }
        )+
    };
}

/// Backends with the linear layer, ELU and sigmoid as single operations (see the module
/// docs). The default methods compose burn's tensor operations; the ndarray backend (f32)
/// runs fused kernels and every `Autodiff<B>` records one node per operation, with the
/// backward steps below.
pub trait FusedOps: Backend {
    /// Whether tensors live in host memory (the ndarray backend): a parameter tensor is then
    /// made from its slice of the flat buffer and its gradient read without a transfer. On a
    /// device (`false`) the model uploads each flat buffer once and reads the gradient back
    /// packed in one tensor ([`crate::params::Params::partitioned_leaves_packed`]).
    const HOST_MEMORY: bool = false;

    /// The linear layer `x Wᵀ + b` (PyTorch `nn.Linear`): `x: [batch, in]`, `weight` the
    /// row-major `[out, in]` matrix flattened to `[out * in]`, `bias: [out]` ->
    /// `[batch, out]`.
    ///
    /// Panics when `weight` does not hold `out * in` values.
    fn fused_linear(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        bias: Tensor<Self, 1>,
    ) -> Tensor<Self, 2> {
        linear_composed(x, weight, bias)
    }

    /// The gradients of [`FusedOps::fused_linear`] for the incoming gradient
    /// `grad: [batch, out]`: `(dx [batch, in], dweight [out * in], dbias [out])`, each only
    /// when `need` asks for it.
    fn fused_linear_backward(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        grad: Tensor<Self, 2>,
        need: [bool; 3],
    ) -> LinearGradients<Self> {
        linear_backward_composed(x, weight, grad, need)
    }

    /// ELU with α = 1, elementwise: `[batch, features]` -> `[batch, features]`.
    fn fused_elu(x: Tensor<Self, 2>) -> Tensor<Self, 2> {
        elu_composed(x)
    }

    /// The gradient of [`FusedOps::fused_elu`] from its output `y` and the incoming
    /// gradient `grad` (same shape): `grad` where `y > 0`, `grad (y + 1)` elsewhere.
    fn fused_elu_backward(y: Tensor<Self, 2>, grad: Tensor<Self, 2>) -> Tensor<Self, 2> {
        elu_backward_composed(y, grad)
    }

    /// The logistic sigmoid `1 / (1 + e^-x)`, elementwise.
    fn fused_sigmoid(x: Tensor<Self, 2>) -> Tensor<Self, 2> {
        sigmoid_composed(x)
    }

    /// The gradient of [`FusedOps::fused_sigmoid`] from its output `s` and the incoming
    /// gradient: `grad s (1 - s)`.
    fn fused_sigmoid_backward(s: Tensor<Self, 2>, grad: Tensor<Self, 2>) -> Tensor<Self, 2> {
        sigmoid_backward_composed(s, grad)
    }

    /// Tensors `[len]` on `device` holding `values` (one per slice), for a pass's parameters.
    /// The default makes each with `Tensor::from_data`; burn's GPU backends place them all
    /// in one allocation with one transfer and no kernel
    /// ([`ComputeClient::create_tensors`](cubecl::client::ComputeClient::create_tensors)), where
    /// cutting one uploaded buffer into parameters (`narrow`) launches a copy kernel for
    /// every parameter whose offset is not a multiple of the device's alignment.
    fn upload_vectors(values: &[&[f32]], device: &Self::Device) -> Vec<Tensor<Self, 1>> {
        values
            .iter()
            .map(|v| {
                Tensor::from_data(burn::tensor::TensorData::new(v.to_vec(), [v.len()]), device)
            })
            .collect()
    }

    /// Whether this backend runs the coupling spline as kernels
    /// ([`FusedOps::spline_kernel_forward`], [`FusedOps::spline_kernel_backward`]: burn's
    /// CubeCL backends, wgpu and CUDA); `Autodiff` over it then records one node per
    /// coupling instead of the composed operations' ~240 launches.
    const SPLINE_KERNEL: bool = false;

    /// The coupling's rational-quadratic spline in the density direction
    /// ([`crate::spline::coupling_spline`] with `inverse = false`): `x: [M, 1]`, the
    /// conditioner's raw output `raw: [M, 3K-1]`, `scale` on the widths and heights ->
    /// `(y [M, 1], log|dy/dx| [M, 1])`. Composed from burn's operations unless the backend
    /// has the kernels.
    fn spline(
        x: Tensor<Self, 2>,
        raw: Tensor<Self, 2>,
        scale: f64,
        sp: &SplineParams,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        crate::spline::coupling_spline(x, raw, scale, false, sp)
    }

    /// [`FusedOps::spline`] as one `[M, 2]` tensor (`y`, `log|dy/dx|`): one kernel launch
    /// on backends with [`FusedOps::SPLINE_KERNEL`]. With `state_start`, `x` is the flow
    /// state `[N, n + 2]` and the inputs its transformed columns (the mask from
    /// `state_start`, [`crate::coupling_kernel`]), `M = N t`. With `bias` (`[t (3K-1)]`, the
    /// conditioner's final layer's) `raw` is that layer's product without it; the kernel
    /// adds it (row `m` gets `bias[(m mod t) (3K-1)..]`).
    fn spline_kernel_forward(
        x: Tensor<Self, 2>,
        raw: Tensor<Self, 2>,
        scale: f64,
        sp: &SplineParams,
        state_start: Option<usize>,
        bias: Option<Tensor<Self, 1>>,
    ) -> Tensor<Self, 2> {
        let x = match state_start {
            Some(start) => transformed_columns(x, start),
            None => x,
        };
        let raw = with_row_bias(raw, bias);
        let (y, ld) = Self::spline(x, raw, scale, sp);
        Tensor::cat(vec![y, ld], 1)
    }

    /// The backward pass of [`FusedOps::spline_kernel_forward`] (the same `state_start` and
    /// `bias`) for the incoming gradient `grad: [M, 2]`: `(dx, draw [M, 3K-1])`, `dx` of
    /// `x`'s shape, one kernel launch (the bias's gradient is `draw`'s column sums).
    ///
    /// Panics on a backend without [`FusedOps::SPLINE_KERNEL`] (`Autodiff` composes the
    /// spline there and never calls this).
    fn spline_kernel_backward(
        _x: Tensor<Self, 2>,
        _raw: Tensor<Self, 2>,
        _grad: Tensor<Self, 2>,
        _scale: f64,
        _sp: &SplineParams,
        _state_start: Option<usize>,
        _bias: Option<Tensor<Self, 1>>,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        panic!("this backend has no spline kernel (FusedOps::SPLINE_KERNEL is false)")
    }

    /// Mixed precision's activation of a float32 `x` in one launch, the casts inside:
    /// `Some((y float32, y float16))` (the activation computed in float16 on `x` cast to
    /// float16, and with `wide` its float32 copy, else `None` for it), `None` where the
    /// backend has no such kernel (then the casts and the activation are separate
    /// operations).
    #[allow(clippy::type_complexity)]
    fn activation_half(
        _activation: Activation,
        _x: Tensor<Self, 2>,
        _wide: bool,
    ) -> Option<(Option<Tensor<Self, 2>>, Tensor<Self, 2>)> {
        None
    }

    /// The gradient of [`FusedOps::activation_half`] from its float16 output and the
    /// incoming gradient (float32 or float16), computed in float16 and returned in float32
    /// (with `narrow` in float16) in one launch; `None` where the backend has no such
    /// kernel.
    fn activation_half_backward(
        _activation: Activation,
        _yh: Tensor<Self, 2>,
        _grad: Tensor<Self, 2>,
        _narrow: bool,
    ) -> Option<Tensor<Self, 2>> {
        None
    }

    /// Whether this backend keeps the training state on its device and runs the optimizer
    /// there ([`crate::resident`], [`crate::optim_kernel`]: burn's CubeCL backends in
    /// float32). The methods below it serve that path; elsewhere they panic.
    fn device_optimizer() -> bool {
        false
    }

    /// `len` values at `offset` of the 1-D `buffer` (float32, or its float16 copy), as a
    /// tensor of its dtype that shares its memory (no copy, no kernel); `offset` a multiple
    /// of 256 bytes (the largest storage-binding alignment an adapter asks for: 64 float32
    /// or 128 float16 values).
    fn view(buffer: &Tensor<Self, 1>, offset: usize, len: usize) -> Tensor<Self, 1> {
        let _ = (buffer, offset, len);
        no_device_optimizer()
    }

    /// Writes each `(src, offset)` of `srcs` into `dst` at `offset` (values; disjoint
    /// ranges, each a multiple of 64), in place (`add`: adds them): up to 16 sources per
    /// launch ([`crate::optim_kernel::pack_many_launch`]).
    fn pack_many_into(srcs: Vec<(Tensor<Self, 1>, usize)>, dst: &Tensor<Self, 1>, add: bool) {
        let _ = (srcs, dst, add);
        no_device_optimizer()
    }

    /// Sets `dst` to zeros in place, one launch.
    fn zero_into(dst: &Tensor<Self, 1>) {
        let _ = dst;
        no_device_optimizer()
    }

    /// `[1]`: 1 when some value of `g` is an infinity or NaN, else 0 (one upload of the 0,
    /// one launch).
    fn non_finite_flag(g: &Tensor<Self, 1>) -> Tensor<Self, 1> {
        let _ = g;
        no_device_optimizer()
    }

    /// One optimizer update in place of the packed `params` and `slots` with the gradient
    /// `grad` ([`lockstep_train::DeviceUpdate`]; one launch).
    fn optimizer_update(
        params: &Tensor<Self, 1>,
        slots: &[Tensor<Self, 1>],
        grad: &Tensor<Self, 1>,
        update: &lockstep_train::DeviceUpdate,
    ) {
        let _ = (params, slots, grad, update);
        no_device_optimizer()
    }

    /// Whether this backend runs LayerNorm (with an ELU after it), the linear layer with an
    /// ELU after it and the gated residual block's tail as kernels
    /// ([`crate::layer_kernel`]: burn's CubeCL backends, wgpu and CUDA, float32): the
    /// layers then call [`FusedOps::fused_layer_norm`], [`FusedOps::linear_elu_at`] and
    /// [`FusedOps::gated_residual`], and `Autodiff` over such a backend records one node for
    /// each. Elsewhere the layers compose them as before.
    const LAYER_KERNELS: bool = false;

    /// LayerNorm over the features of each row (PyTorch `nn.LayerNorm`: biased variance,
    /// `eps` added to it, affine), followed by ELU (α = 1) when `elu`: `x: [rows, cols]`,
    /// `weight`, `bias: [cols]` -> `[rows, cols]`. The default composes burn's operations.
    fn fused_layer_norm(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        bias: Tensor<Self, 1>,
        eps: f64,
        elu: bool,
    ) -> Tensor<Self, 2> {
        layer_norm_composed(x, weight, bias, eps, elu)
    }

    /// [`FusedOps::fused_layer_norm`] as one kernel launch: `(y [rows, cols], stats [rows, 2])`,
    /// `stats` holding each row's mean and `1 / sqrt(var + eps)` for the backward kernel.
    ///
    /// Panics on a backend without [`FusedOps::LAYER_KERNELS`].
    fn layer_norm_kernel_forward(
        _x: Tensor<Self, 2>,
        _weight: Tensor<Self, 1>,
        _bias: Tensor<Self, 1>,
        _eps: f64,
        _elu: bool,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        no_layer_kernels()
    }

    /// The gradients `(dx [rows, cols], dweight [cols], dbias [cols])` of
    /// [`FusedOps::layer_norm_kernel_forward`] from its input `x`, `weight`, output `y`,
    /// `stats` and the incoming gradient `grad: [rows, cols]`, as one kernel launch.
    ///
    /// Panics on a backend without [`FusedOps::LAYER_KERNELS`].
    fn layer_norm_kernel_backward(
        _x: Tensor<Self, 2>,
        _weight: Tensor<Self, 1>,
        _y: Tensor<Self, 2>,
        _stats: Tensor<Self, 2>,
        _grad: Tensor<Self, 2>,
        _elu: bool,
    ) -> (Tensor<Self, 2>, Tensor<Self, 1>, Tensor<Self, 1>) {
        no_layer_kernels()
    }

    /// `elu(x Wᵀ + b)` at `precision` (arguments as [`FusedOps::linear_at`]); on a backend
    /// with [`FusedOps::LAYER_KERNELS`] the matrix product and one kernel for the bias and
    /// ELU. At [`Precision::Half`] the output is float16, the ELU of the float16 sum (as
    /// [`FusedOps::elu_at`] returns it), for the float16 product of the next layer.
    fn linear_elu_at(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        weight_f16: Option<Tensor<Self, 1>>,
        bias: Tensor<Self, 1>,
        precision: Precision,
    ) -> Tensor<Self, 2> {
        Self::elu_at(
            Self::linear_at(x, weight, weight_f16, bias, precision),
            precision,
        )
    }

    /// The product `x Wᵀ` of a linear layer without its bias (`x: [rows, inputs]`, `weight`
    /// flat `[outputs * inputs]`), differentiable as one node whose backward step computes
    /// `dx = g W` and `dW = gᵀ x` directly (burn's matrix product of a transposed weight
    /// would copy its gradient to make it contiguous).
    fn linear_product(x: Tensor<Self, 2>, weight: Tensor<Self, 1>) -> Tensor<Self, 2> {
        product(x, weight)
    }

    /// A residual block's end `x + (t Wᵀ + b)` (`x: [rows, outputs]`, `t: [rows, inputs]`,
    /// `weight` flat `[outputs * inputs]`, `bias: [outputs]`); on a backend with
    /// [`FusedOps::LAYER_KERNELS`] the matrix product and one kernel for both additions.
    fn linear_residual(
        x: Tensor<Self, 2>,
        t: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        bias: Tensor<Self, 1>,
    ) -> Tensor<Self, 2> {
        x + Self::fused_linear(t, weight, bias)
    }

    /// `x + (a + bias)` (`x`, `a: [rows, cols]`, `bias: [cols]`) as one kernel launch.
    ///
    /// Panics on a backend without [`FusedOps::LAYER_KERNELS`].
    fn residual_kernel_forward(
        _x: Tensor<Self, 2>,
        _a: Tensor<Self, 2>,
        _bias: Tensor<Self, 1>,
    ) -> Tensor<Self, 2> {
        no_layer_kernels()
    }

    /// `a + bias` (`a: [rows, cols]`, `bias: [cols]`), followed by ELU when `elu`, as one
    /// kernel launch.
    ///
    /// Panics on a backend without [`FusedOps::LAYER_KERNELS`].
    fn bias_kernel_forward(
        _a: Tensor<Self, 2>,
        _bias: Tensor<Self, 1>,
        _elu: bool,
    ) -> Tensor<Self, 2> {
        no_layer_kernels()
    }

    /// The gradients `(da [rows, cols], dbias [cols])` of [`FusedOps::bias_kernel_forward`]
    /// from its output `y` and the incoming gradient, as one kernel launch.
    ///
    /// Panics on a backend without [`FusedOps::LAYER_KERNELS`].
    fn bias_kernel_backward(
        _y: Tensor<Self, 2>,
        _grad: Tensor<Self, 2>,
        _elu: bool,
    ) -> (Tensor<Self, 2>, Tensor<Self, 1>) {
        no_layer_kernels()
    }

    /// The tail of a context-gated residual block (nflows' `ResidualBlock` with a context
    /// layer): `x + (t W₁ᵀ + b₁) sigmoid(context W_cᵀ + b_c)`, `x: [rows, features]`,
    /// `t: [rows, features]` (the block's second linear layer's input), `w1` flat
    /// `[features * features]`, `context: [rows, context_features]`, `wc` flat
    /// `[features * context_features]`, `b1`, `bc: [features]`. On a backend with
    /// [`FusedOps::LAYER_KERNELS`] the block's matrix product and one kernel (which sums
    /// the context's product itself). At [`Precision::Half`] the block's product `t W₁ᵀ` is
    /// float16 (the input and the weight cast, as for every linear layer) and the rest runs
    /// in the float32 kernel: the gate's context product, the sigmoid and the tail in
    /// float32 (autocast would compute the context layer in float16 too); elsewhere both
    /// layers and the sigmoid follow [`FusedOps::linear_at`] and [`FusedOps::sigmoid_at`].
    /// `t` may be float16 at [`Precision::Half`] (an activation's output), and `w1_f16` is
    /// `w1`'s float16 copy when the pass has one (as for [`FusedOps::linear_at`]).
    #[allow(clippy::too_many_arguments)]
    fn gated_residual(
        x: Tensor<Self, 2>,
        t: Tensor<Self, 2>,
        w1: Tensor<Self, 1>,
        w1_f16: Option<Tensor<Self, 1>>,
        b1: Tensor<Self, 1>,
        context: Tensor<Self, 2>,
        wc: Tensor<Self, 1>,
        bc: Tensor<Self, 1>,
        precision: Precision,
    ) -> Tensor<Self, 2> {
        gated_composed(x, t, (w1, w1_f16), b1, context, wc, bc, precision)
    }

    /// `(y, s)`: `y = x + (a + b1) s`, `s = sigmoid(context wcᵀ + bc)` (`x`, `a`:
    /// `[rows, features]`, `a` float32 or mixed precision's float16; `context: [rows, context_features]`; `wc` flat
    /// `[features * context_features]`; `b1`, `bc`: `[features]`), as one kernel launch
    /// ([`crate::layer_kernel`]).
    ///
    /// Panics on a backend without [`FusedOps::LAYER_KERNELS`].
    fn gated_kernel_forward(
        _x: Tensor<Self, 2>,
        _a: Tensor<Self, 2>,
        _b1: Tensor<Self, 1>,
        _context: Tensor<Self, 2>,
        _wc: Tensor<Self, 1>,
        _bc: Tensor<Self, 1>,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        no_layer_kernels()
    }

    /// The gradients `(da, dcontext, dwc, db1, dbc)` of [`FusedOps::gated_kernel_forward`]
    /// (with its `s`) for the incoming gradient (that of `x` is the incoming gradient
    /// itself), as one kernel launch.
    ///
    /// Panics on a backend without [`FusedOps::LAYER_KERNELS`].
    fn gated_kernel_backward(
        _a: Tensor<Self, 2>,
        _b1: Tensor<Self, 1>,
        _s: Tensor<Self, 2>,
        _context: Tensor<Self, 2>,
        _wc: Tensor<Self, 1>,
        _grad: Tensor<Self, 2>,
    ) -> GatedGradients<Self> {
        no_layer_kernels()
    }

    /// A flow step's LU-factorized affine map (nflows' `LULinear`, `W = L U`, see
    /// [`lu_weight_composed`], bias `bias: [n]`, the step's permutation `perm` first) as one
    /// `[n + 2, n + 2]` matrix `A` acting on the flow state `[N, n + 2]` (features,
    /// log-determinant, ones): `state A` is the next state, the features mapped, the
    /// log-determinant plus `Σ_j ln u_jj` (`u_jj = softplus(diag_j) + eps`), the ones kept
    /// (see [`crate::lu_kernel`]). From the strictly lower and strictly upper entries
    /// (`[n(n-1)/2]` each, row-major) and the unconstrained diagonal `diag: [n]`. On a
    /// backend with [`FusedOps::LAYER_KERNELS`] one kernel each way.
    fn lu_affine(
        lower: Tensor<Self, 1>,
        upper: Tensor<Self, 1>,
        diag: Tensor<Self, 1>,
        bias: Tensor<Self, 1>,
        eps: f64,
        perm: Option<&[usize]>,
    ) -> Tensor<Self, 2> {
        lu_affine_composed(lower, upper, diag, bias, eps, perm)
    }

    /// [`FusedOps::lu_affine`] as one kernel launch, the permutation given as float32
    /// values (`[n]`).
    ///
    /// Panics on a backend without [`FusedOps::LAYER_KERNELS`].
    fn lu_affine_kernel_forward(
        _lower: Tensor<Self, 1>,
        _upper: Tensor<Self, 1>,
        _diag: Tensor<Self, 1>,
        _bias: Tensor<Self, 1>,
        _perm: Option<Tensor<Self, 1>>,
        _eps: f64,
    ) -> Tensor<Self, 2> {
        no_layer_kernels()
    }

    /// The gradients `[dlower, dupper, ddiag, dbias]` of
    /// [`FusedOps::lu_affine_kernel_forward`] (with the same permutation) for the gradient
    /// `da: [n + 2, n + 2]` of its output, as one kernel launch.
    ///
    /// Panics on a backend without [`FusedOps::LAYER_KERNELS`].
    fn lu_affine_kernel_backward(
        _lower: Tensor<Self, 1>,
        _upper: Tensor<Self, 1>,
        _diag: Tensor<Self, 1>,
        _perm: Option<Tensor<Self, 1>>,
        _da: Tensor<Self, 2>,
        _eps: f64,
    ) -> [Tensor<Self, 1>; 4] {
        no_layer_kernels()
    }

    /// [`FusedOps::spline`] as one `[M, 2]` tensor (`y`, `log|dy/dx|`), differentiable: one
    /// node (one kernel each way) on `Autodiff` over a backend with
    /// [`FusedOps::SPLINE_KERNEL`]. With `state_start` the inputs are the transformed
    /// columns of the flow state `x: [N, n + 2]`; with `bias` `raw` is the conditioner's
    /// final product without its bias (see [`FusedOps::spline_kernel_forward`]).
    fn spline_joint(
        x: Tensor<Self, 2>,
        raw: Tensor<Self, 2>,
        scale: f64,
        sp: &SplineParams,
        state_start: Option<usize>,
        bias: Option<Tensor<Self, 1>>,
    ) -> Tensor<Self, 2> {
        Self::spline_kernel_forward(x, raw, scale, sp, state_start, bias)
    }

    /// A coupling step's conditioner input `[N, (n - t) + C]` from the flow state
    /// `state: [N, n + 2]` and the context `ctx: [N, C]`: the untransformed features (Dingo's
    /// alternating mask at `start`, 0 or 1: feature `f` is transformed when `f >= start` and
    /// `f - start` is even) next to the context. One kernel each way on a backend with
    /// [`FusedOps::LAYER_KERNELS`] ([`crate::coupling_kernel`]).
    fn coupling_split(
        state: Tensor<Self, 2>,
        ctx: Tensor<Self, 2>,
        start: usize,
    ) -> Tensor<Self, 2> {
        coupling_split_composed(state, ctx, start)
    }

    /// [`FusedOps::coupling_split`] as one kernel launch.
    ///
    /// Panics on a backend without [`FusedOps::LAYER_KERNELS`].
    fn coupling_split_kernel_forward(
        _state: Tensor<Self, 2>,
        _ctx: Tensor<Self, 2>,
        _start: usize,
    ) -> Tensor<Self, 2> {
        no_layer_kernels()
    }

    /// The gradients `(dstate [N, w], dctx [N, C])` of
    /// [`FusedOps::coupling_split_kernel_forward`] for the incoming `grad: [N, (n - t) + C]`
    /// and a state of width `w`, as one kernel launch.
    ///
    /// Panics on a backend without [`FusedOps::LAYER_KERNELS`].
    fn coupling_split_kernel_backward(
        _grad: Tensor<Self, 2>,
        _w: usize,
        _start: usize,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        no_layer_kernels()
    }

    /// A coupling step's next flow state `[N, n + 2]` from the state and the spline's
    /// `both: [N t, 2]` ([`FusedOps::spline_joint`] of its `t` transformed features): those
    /// features replaced by the spline's values, the others and the ones column kept, the
    /// log-determinant plus each row's `Σ log|dy/dx|` (mask as in
    /// [`FusedOps::coupling_split`]). One kernel each way on a backend with
    /// [`FusedOps::LAYER_KERNELS`] ([`crate::coupling_kernel`]).
    fn coupling_place(
        state: Tensor<Self, 2>,
        both: Tensor<Self, 2>,
        start: usize,
    ) -> Tensor<Self, 2> {
        coupling_place_composed(state, both, start)
    }

    /// [`FusedOps::coupling_place`] as one kernel launch.
    ///
    /// Panics on a backend without [`FusedOps::LAYER_KERNELS`].
    fn coupling_place_kernel_forward(
        _state: Tensor<Self, 2>,
        _both: Tensor<Self, 2>,
        _start: usize,
    ) -> Tensor<Self, 2> {
        no_layer_kernels()
    }

    /// The gradients `(dstate [N, n + 2], dboth [N t, 2])` of
    /// [`FusedOps::coupling_place_kernel_forward`] for the incoming `grad: [N, n + 2]`, as
    /// one kernel launch.
    ///
    /// Panics on a backend without [`FusedOps::LAYER_KERNELS`].
    fn coupling_place_kernel_backward(
        _grad: Tensor<Self, 2>,
        _start: usize,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        no_layer_kernels()
    }

    /// The flow's base log-density with its log-determinant from the final flow state
    /// `state: [N, n + 2]`: `((-0.5 Σ_{j<n} z_j² - c) + logdet) - jac` per row -> `[N]`
    /// (`c = n/2 ln 2π`, `jac` the standardization's `Σ ln σ_θ`). One kernel each way on a
    /// backend with [`FusedOps::LAYER_KERNELS`] (float32), burn's operations elsewhere.
    fn base_log_prob(state: Tensor<Self, 2>, c: f64, jac: f64) -> Tensor<Self, 1> {
        let (z, logdet) = state_parts(state);
        base_log_prob_composed(z, logdet, c, jac)
    }

    /// [`FusedOps::base_log_prob`] as one kernel launch.
    ///
    /// Panics on a backend without [`FusedOps::LAYER_KERNELS`].
    fn base_log_prob_kernel_forward(
        _state: Tensor<Self, 2>,
        _c: f64,
        _jac: f64,
    ) -> Tensor<Self, 1> {
        no_layer_kernels()
    }

    /// The gradient `dstate: [N, n + 2]` of [`FusedOps::base_log_prob_kernel_forward`] for
    /// the incoming `grad: [N]`, as one kernel launch.
    ///
    /// Panics on a backend without [`FusedOps::LAYER_KERNELS`].
    fn base_log_prob_kernel_backward(
        _state: Tensor<Self, 2>,
        _grad: Tensor<Self, 1>,
    ) -> Tensor<Self, 2> {
        no_layer_kernels()
    }

    /// `x` itself, whose gradient is the incoming one times `factor` (an autodiff node on
    /// `Autodiff<B>`: no launch forward, one backward). A training pass starts the
    /// backward pass from `scale_gradient(log q, -loss_scale / N)` instead of from
    /// `-mean(log q) loss_scale`: the same gradient, without the reduction, negation and
    /// scaling launches of the loss and their backward (7 launches, 2 instead).
    fn scale_gradient(x: Tensor<Self, 1>, _factor: f64) -> Tensor<Self, 1> {
        x
    }

    /// [`FusedOps::fused_linear`] at `precision`: [`Precision::Half`] computes the matrix
    /// product and the bias in f16 and returns the result in the bias's dtype (float32).
    /// `x` may come in float16 already (an activation's output at [`Precision::Half`]), and
    /// `weight_f16` is the weight's float16 copy where the pass made one for all parameters
    /// at once ([`crate::params::Params::weight_f16`]: one cast per pass, not one per layer);
    /// the gradient goes to `weight` (the float32 master weight). `weight_f16` is ignored at
    /// [`Precision::F32`].
    fn linear_at(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        weight_f16: Option<Tensor<Self, 1>>,
        bias: Tensor<Self, 1>,
        precision: Precision,
    ) -> Tensor<Self, 2> {
        match precision {
            Precision::F32 => Self::fused_linear(x, weight, bias),
            Precision::Half => linear_half(x, weight_f16.unwrap_or(weight), bias),
        }
    }

    /// The gradients of [`FusedOps::linear_at`] at `precision` (see
    /// [`FusedOps::fused_linear_backward`]): [`Precision::Half`] casts the incoming gradient
    /// to float16 first (a scaled gradient beyond 65504 becomes infinite, as in PyTorch's
    /// autocast, for the loss scaler to see; it may come in float16 already, from a kernel
    /// that wrote it so), computes in float16 and returns float32.
    fn linear_backward_at(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        grad: Tensor<Self, 2>,
        need: [bool; 3],
        precision: Precision,
    ) -> LinearGradients<Self> {
        match precision {
            Precision::F32 => Self::fused_linear_backward(x, weight, grad, need),
            Precision::Half => linear_backward_half(x, weight, grad, need),
        }
    }

    /// [`FusedOps::fused_elu`] at `precision` ([`Precision::Half`]: computed in f16 and
    /// returned in f16, as autocast's ELU of a linear layer's float16 output: the ELUs of the
    /// models feed linear layers, whose float16 products read it without a cast).
    fn elu_at(x: Tensor<Self, 2>, precision: Precision) -> Tensor<Self, 2> {
        match precision {
            Precision::F32 => Self::fused_elu(x),
            Precision::Half => Self::fused_elu(x.cast(FloatDType::F16)),
        }
    }

    /// [`FusedOps::fused_sigmoid`] at `precision` ([`Precision::Half`]: computed in f16,
    /// returned in the input's dtype).
    fn sigmoid_at(x: Tensor<Self, 2>, precision: Precision) -> Tensor<Self, 2> {
        match precision {
            Precision::F32 => Self::fused_sigmoid(x),
            Precision::Half => in_half(x, Self::fused_sigmoid),
        }
    }
}

/// The precision the linear layers and activations of a pass compute in.
///
/// [`Precision::Half`] is mixed precision as PyTorch's autocast applies it to `nn.Linear`
/// and the activations that follow: the operands are cast to float16 (IEEE binary16: 11-bit
/// significand, largest finite value 65504), the matrix products (forward and backward),
/// bias additions and activations run in float16, and the results return to float32 (an
/// ELU's float16 output goes to the next linear layer's float16 product as it is); the
/// parameters (master weights), the spline and LU transforms, the normalizations, the
/// log-determinants, the log-probability and the loss stay float32 (on the GPU backends the
/// ELU after a LayerNorm is computed in float32 inside the LayerNorm's kernel, whose input
/// and output are float32, and a gated residual block's context layer, sigmoid and tail in
/// float32 inside its kernel, [`FusedOps::gated_residual`], the block's product float16). Only GPU backends run
/// it (wgpu with `SHADER_F16`, CUDA); the training passes of `automatic_mixed_precision`
/// use it, evaluation passes (validation, sampling) compute in float32.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    /// Everything in float32.
    #[default]
    F32,
    /// Linear layers and activations in float16 (see the type's docs).
    Half,
}

/// `f(x)` computed on `x` cast to float16, the result cast back to `x`'s dtype.
fn in_half<B: Backend>(
    x: Tensor<B, 2>,
    f: impl FnOnce(Tensor<B, 2>) -> Tensor<B, 2>,
) -> Tensor<B, 2> {
    let dtype = x.dtype();
    f(x.cast(FloatDType::F16)).cast(dtype)
}

/// `g(a, b)` computed on `a` and `b` cast to float16, the result cast back to `b`'s dtype.
fn in_half2<B: Backend>(
    a: Tensor<B, 2>,
    b: Tensor<B, 2>,
    g: fn(Tensor<B, 2>, Tensor<B, 2>) -> Tensor<B, 2>,
) -> Tensor<B, 2> {
    let dtype = b.dtype();
    g(a.cast(FloatDType::F16), b.cast(FloatDType::F16)).cast(dtype)
}

/// The linear layer with its product and bias in float16 ([`Precision::Half`]), returned
/// in the bias's dtype (the parameters' float32; the input and the weight may come cast to
/// float16 already).
fn linear_half<B: Backend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 1>,
    bias: Tensor<B, 1>,
) -> Tensor<B, 2> {
    let dtype = bias.dtype();
    let h = FloatDType::F16;
    linear_composed(x.cast(h), weight.cast(h), bias.cast(h)).cast(dtype)
}

/// The linear layer's gradients with the products in float16 ([`Precision::Half`]): the
/// incoming gradient is cast to float16 first, so a (scaled) gradient beyond 65504
/// becomes infinite, as in PyTorch's autocast, for the loss scaler to see.
fn linear_backward_half<B: Backend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 1>,
    grad: Tensor<B, 2>,
    need: [bool; 3],
) -> LinearGradients<B> {
    let dtype = grad.dtype();
    let h = FloatDType::F16;
    let (dx, dw, db) = linear_backward_composed(x.cast(h), weight.cast(h), grad.cast(h), need);
    (
        dx.map(|t| t.cast(dtype)),
        dw.map(|t| t.cast(dtype)),
        db.map(|t| t.cast(dtype)),
    )
}

/// The gradients of a linear layer: `(dx, dweight, dbias)` (see
/// [`FusedOps::fused_linear_backward`]).
pub type LinearGradients<B> = (
    Option<Tensor<B, 2>>,
    Option<Tensor<B, 1>>,
    Option<Tensor<B, 1>>,
);

/// The gradients of the gated tail's kernel: `(da [rows, features], dcontext [rows,
/// context_features], dwc [features * context_features], db1, dbc [features])` (see
/// [`FusedOps::gated_kernel_backward`]).
pub type GatedGradients<B> = (
    Tensor<B, 2>,
    Tensor<B, 2>,
    Tensor<B, 1>,
    Tensor<B, 1>,
    Tensor<B, 1>,
);

fn no_device_optimizer() -> ! {
    panic!("this backend keeps no training state on a device (FusedOps::device_optimizer is false)")
}

fn no_layer_kernels() -> ! {
    panic!("this backend has no layer kernels (FusedOps::LAYER_KERNELS is false)")
}

/// [`FusedOps::gated_residual`] from the linear layers and the sigmoid at `precision`.
#[allow(clippy::too_many_arguments)]
fn gated_composed<B: FusedOps>(
    x: Tensor<B, 2>,
    t: Tensor<B, 2>,
    (w1, w1_f16): (Tensor<B, 1>, Option<Tensor<B, 1>>),
    b1: Tensor<B, 1>,
    context: Tensor<B, 2>,
    wc: Tensor<B, 1>,
    bc: Tensor<B, 1>,
    precision: Precision,
) -> Tensor<B, 2> {
    let gate = B::sigmoid_at(B::linear_at(context, wc, None, bc, precision), precision);
    x + B::linear_at(t, w1, w1_f16, b1, precision) * gate
}

/// The block's product `t W₁ᵀ` of a gated tail at `precision` (float16 operands and product
/// at [`Precision::Half`], which the gated kernel reads as they are) and the operands as the
/// backward step keeps them.
fn gated_product<B: Backend>(
    t: Tensor<B, 2>,
    w1: Tensor<B, 1>,
    w1_f16: Option<Tensor<B, 1>>,
    precision: Precision,
) -> (Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 1>) {
    match precision {
        Precision::F32 => (product(t.clone(), w1.clone()), t, w1),
        Precision::Half => {
            // The float16 product goes to the kernel as it is (the kernel widens it). The
            // casts are no-ops for a float16 `t` and a pass's float16 weight copy.
            let w1 = w1_f16.unwrap_or(w1);
            let (t, w1) = (t.cast(FloatDType::F16), w1.cast(FloatDType::F16));
            (product(t.clone(), w1.clone()), t, w1)
        }
    }
}

/// LayerNorm composed from burn's operations (as `layers::NormLayer` computes it), then
/// [`FusedOps::fused_elu`] when `elu`.
fn layer_norm_composed<B: FusedOps>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 1>,
    bias: Tensor<B, 1>,
    eps: f64,
    elu: bool,
) -> Tensor<B, 2> {
    let (var, mean) = x.clone().var_mean_bias(1);
    let y = (x - mean) / var.add_scalar(eps).sqrt();
    let y = y * weight.unsqueeze_dim(0) + bias.unsqueeze_dim(0);
    if elu {
        B::fused_elu(y)
    } else {
        y
    }
}

/// Where each entry of an LU map's `L` and `U` (`n x n`, row-major) comes from: `L`'s from
/// `[0, 1, lower...]`, `U`'s from `[0, u_00..u_{n-1,n-1}, upper...]` (numpy's
/// `tril_indices(n, -1)` and `triu_indices(n, 1)` order for the strict triangles).
pub fn lu_indices(n: usize) -> (Vec<usize>, Vec<usize>) {
    let mut l_index = vec![0usize; n * n];
    let mut u_index = vec![0usize; n * n];
    let (mut kl, mut ku) = (0, 0);
    for i in 0..n {
        for j in 0..n {
            if j < i {
                l_index[i * n + j] = 2 + kl;
                kl += 1;
            } else if i == j {
                l_index[i * n + j] = 1;
                u_index[i * n + j] = 1 + i;
            } else {
                u_index[i * n + j] = 1 + n + ku;
                ku += 1;
            }
        }
    }
    (l_index, u_index)
}

/// nflows' `LULinear` weight composed from burn's operations: `(W = L U [n, n],
/// diag(U) [n])`, `L` unit lower-triangular with the strictly lower entries `lower`, `U`
/// upper-triangular with diagonal `softplus(diag) + eps` and strictly upper entries
/// `upper` (see [`lu_indices`]).
pub fn lu_weight_composed<B: Backend>(
    lower: Tensor<B, 1>,
    upper: Tensor<B, 1>,
    diag: Tensor<B, 1>,
    eps: f64,
) -> (Tensor<B, 2>, Tensor<B, 1>) {
    let device = diag.device();
    let [n] = diag.dims();
    let (l_index, u_index) = lu_indices(n);
    let index = |idx: &[usize]| index_of::<B>(idx, &device);
    let diag = softplus(diag, 1.0).add_scalar(eps);
    let lv = Tensor::cat(
        vec![
            diag.clone().narrow(0, 0, 1).zeros_like(),
            diag.clone().narrow(0, 0, 1).ones_like(),
            lower,
        ],
        0,
    );
    let uv = Tensor::cat(
        vec![
            diag.clone().narrow(0, 0, 1).zeros_like(),
            diag.clone(),
            upper,
        ],
        0,
    );
    let l = lv.select(0, index(&l_index)).reshape([n, n]);
    let u = uv.select(0, index(&u_index)).reshape([n, n]);
    (l.matmul(u), diag)
}

/// An index tensor of `idx` on `device` (for `select`).
pub(crate) fn index_of<B: Backend>(
    idx: &[usize],
    device: &B::Device,
) -> Tensor<B, 1, burn::tensor::Int> {
    let v: Vec<i64> = idx.iter().map(|&i| i as i64).collect();
    Tensor::from_data(burn::tensor::TensorData::new(v, [idx.len()]), device)
}

/// The features of a flow state of width `w` (`n = w - 2`) that the coupling with mask
/// `start` transforms, and those it keeps, in order.
fn mask_columns(w: usize, start: usize) -> (Vec<usize>, Vec<usize>) {
    let n = w - 2;
    (0..n).partition(|&f| f >= start && (f - start).is_multiple_of(2))
}

/// The transformed features of the flow state `state: [N, n + 2]` as `[N t, 1]` (row
/// `r t + j`: row `r`'s `j`-th).
fn transformed_columns<B: Backend>(state: Tensor<B, 2>, start: usize) -> Tensor<B, 2> {
    let [rows, w] = state.dims();
    let (tr, _) = mask_columns(w, start);
    let device = state.device();
    state
        .select(1, index_of::<B>(&tr, &device))
        .reshape([rows * tr.len(), 1])
}

/// `raw: [N t, W]` plus the final layer's `bias: [t W]` (row `m` gets `bias[(m mod t) W..]`),
/// or `raw` itself.
fn with_row_bias<B: Backend>(raw: Tensor<B, 2>, bias: Option<Tensor<B, 1>>) -> Tensor<B, 2> {
    let Some(bias) = bias else {
        return raw;
    };
    let [m, width] = raw.dims();
    let [len] = bias.dims();
    let rows = m * width / len;
    (raw.reshape([rows, len]) + bias.unsqueeze_dim(0)).reshape([m, width])
}

/// `(z [N, n], logdet [N])` of a flow state `[N, n + 2]`.
pub(crate) fn state_parts<B: Backend>(state: Tensor<B, 2>) -> (Tensor<B, 2>, Tensor<B, 1>) {
    let [rows, w] = state.dims();
    let n = w - 2;
    (
        state.clone().narrow(1, 0, n),
        state.narrow(1, n, 1).reshape([rows]),
    )
}

/// [`FusedOps::lu_affine`] composed from burn's operations.
fn lu_affine_composed<B: Backend>(
    lower: Tensor<B, 1>,
    upper: Tensor<B, 1>,
    diag: Tensor<B, 1>,
    bias: Tensor<B, 1>,
    eps: f64,
    perm: Option<&[usize]>,
) -> Tensor<B, 2> {
    let [n] = diag.dims();
    let (w, u) = lu_weight_composed(lower, upper, diag, eps);
    let m = permute_rows(w.transpose(), perm);
    // Zeros and ones built from the operands, in their dtype.
    let zero = m.clone().narrow(0, 0, 1).narrow(1, 0, 1).zeros_like();
    let one = zero.clone().add_scalar(1.0);
    let top = Tensor::cat(vec![m, zero.clone().repeat_dim(0, n).repeat_dim(1, 2)], 1);
    let b = bias.reshape([1, n]);
    let carry = Tensor::cat(vec![b.clone().zeros_like(), one.clone(), zero], 1);
    let ld = u.log().sum().reshape([1, 1]);
    let last = Tensor::cat(vec![b, ld, one], 1);
    Tensor::cat(vec![top, carry, last], 0)
}

/// [`FusedOps::coupling_split`] composed from burn's operations (a gather, a concatenation).
fn coupling_split_composed<B: Backend>(
    state: Tensor<B, 2>,
    ctx: Tensor<B, 2>,
    start: usize,
) -> Tensor<B, 2> {
    let [_, w] = state.dims();
    let (_, ids) = mask_columns(w, start);
    let device = state.device();
    Tensor::cat(vec![state.select(1, index_of::<B>(&ids, &device)), ctx], 1)
}

/// [`FusedOps::coupling_place`] composed from burn's operations (slices, a row sum, a
/// concatenation, a gather).
fn coupling_place_composed<B: Backend>(
    state: Tensor<B, 2>,
    both: Tensor<B, 2>,
    start: usize,
) -> Tensor<B, 2> {
    let [rows, w] = state.dims();
    let n = w - 2;
    let (tr, ids) = mask_columns(w, start);
    let t = tr.len();
    let m = rows * t;
    let device = state.device();
    let y = both.clone().slice([0..m, 0..1]).reshape([rows, t]);
    let ld = both.slice([0..m, 1..2]).reshape([rows, t]).sum_dim(1);
    // Where column f sits in cat(kept, transformed, log-determinant, ones).
    let mut order = vec![0usize; w];
    for (pos, &f) in ids.iter().chain(&tr).enumerate() {
        order[f] = pos;
    }
    order[n] = n;
    order[n + 1] = n + 1;
    let kept = state.clone().select(1, index_of::<B>(&ids, &device));
    let logdet = state.clone().narrow(1, n, 1) + ld;
    let ones = state.narrow(1, n + 1, 1);
    Tensor::cat(vec![kept, y, logdet, ones], 1).select(1, index_of::<B>(&order, &device))
}
/// `wt` with its rows permuted by `perm` (`M[perm[j]] = wt[j]`), or `wt` itself.
fn permute_rows<B: Backend>(wt: Tensor<B, 2>, perm: Option<&[usize]>) -> Tensor<B, 2> {
    let Some(perm) = perm else {
        return wt;
    };
    let mut inverse = vec![0; perm.len()];
    for (j, &p) in perm.iter().enumerate() {
        inverse[p] = j;
    }
    let device = wt.device();
    wt.select(0, index_of::<B>(&inverse, &device))
}

/// A permutation's values as a float32 tensor on `device` (exact below 2^24), for the LU
/// weight kernel.
fn permutation_values<B: Backend>(perm: &[usize], device: &B::Device) -> Tensor<B, 1> {
    let values: Vec<f32> = perm.iter().map(|&p| p as f32).collect();
    Tensor::from_data(burn::tensor::TensorData::new(values, [perm.len()]), device)
}

/// The base log-density `((-0.5 Σ_j z_j² - c) + logdet) - jac` per row of `z: [N, n]`,
/// `logdet: [N]`, composed from burn's operations ([`FusedOps::base_log_prob`] on the
/// state).
pub(crate) fn base_log_prob_composed<B: Backend>(
    z: Tensor<B, 2>,
    logdet: Tensor<B, 1>,
    c: f64,
    jac: f64,
) -> Tensor<B, 1> {
    let [rows] = logdet.dims();
    let base = z
        .powi_scalar(2)
        .sum_dim(1)
        .reshape([rows])
        .mul_scalar(-0.5)
        .sub_scalar(c);
    (base + logdet).sub_scalar(jac)
}

/// The matrix product `x Wᵀ` of a linear layer without its bias (`weight` flat
/// `[outputs * inputs]`).
fn product<B: Backend>(x: Tensor<B, 2>, weight: Tensor<B, 1>) -> Tensor<B, 2> {
    let [_, inputs] = x.dims();
    let [len] = weight.dims();
    x.matmul(weight.reshape([len / inputs, inputs]).transpose())
}

fn linear_composed<B: Backend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 1>,
    bias: Tensor<B, 1>,
) -> Tensor<B, 2> {
    let [_, inputs] = x.dims();
    let [outputs] = bias.dims();
    x.matmul(weight.reshape([outputs, inputs]).transpose()) + bias.unsqueeze_dim(0)
}

fn linear_backward_composed<B: Backend>(
    x: Tensor<B, 2>,
    weight: Tensor<B, 1>,
    grad: Tensor<B, 2>,
    need: [bool; 3],
) -> LinearGradients<B> {
    let [_, inputs] = x.dims();
    let [_, outputs] = grad.dims();
    let dx = need[0].then(|| grad.clone().matmul(weight.reshape([outputs, inputs])));
    let dw = need[1].then(|| {
        grad.clone()
            .transpose()
            .matmul(x)
            .reshape([outputs * inputs])
    });
    let db = need[2].then(|| grad.sum_dim(0).reshape([outputs]));
    (dx, dw, db)
}

fn elu_composed<B: Backend>(x: Tensor<B, 2>) -> Tensor<B, 2> {
    let negative = x.clone().lower_equal_elem(0.0);
    x.clone()
        .mask_where(negative, x.clamp_max(0.0).exp().sub_scalar(1.0))
}

fn elu_backward_composed<B: Backend>(y: Tensor<B, 2>, grad: Tensor<B, 2>) -> Tensor<B, 2> {
    let positive = y.clone().greater_elem(0.0);
    grad * y.add_scalar(1.0).mask_fill(positive, 1.0)
}

fn sigmoid_composed<B: Backend>(x: Tensor<B, 2>) -> Tensor<B, 2> {
    x.neg().exp().add_scalar(1.0).recip()
}

fn sigmoid_backward_composed<B: Backend>(s: Tensor<B, 2>, grad: Tensor<B, 2>) -> Tensor<B, 2> {
    grad * s.clone() * s.neg().add_scalar(1.0)
}

/// `[M, 2]` -> its columns `(y [M, 1], log|dy/dx| [M, 1])`.
fn split_spline<B: Backend>(both: Tensor<B, 2>) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let m = both.dims()[0];
    (both.clone().slice([0..m, 0..1]), both.slice([0..m, 1..2]))
}

impl FusedOps for NdArray<f64> {
    const HOST_MEMORY: bool = true;
}

/// burn's GPU backends (`local.device: gpu` is wgpu's, `cuda` CUDA's): the linear layer
/// composed from burn's operations; ELU and the sigmoid (float32, float16), the coupling
/// spline and the layer kernels ([`FusedOps::LAYER_KERNELS`]) as lockstep's kernels
/// ([`crate::activation_kernel`], [`crate::spline_kernel`], [`crate::layer_kernel`],
/// [`crate::lu_kernel`], [`crate::coupling_kernel`]); the parameters placed in one
/// allocation.
impl<R, F, I, BT> FusedOps for burn_cubecl::CubeBackend<R, F, I, BT>
where
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
    const SPLINE_KERNEL: bool = true;

    fn upload_vectors(values: &[&[f32]], device: &Self::Device) -> Vec<Tensor<Self, 1>> {
        use burn::tensor::DType;
        use cubecl::server::{MemoryLayoutDescriptor, MemoryLayoutStrategy};
        // The parameters are float32 values; a backend of another float type converts them
        // through `from_data`.
        let empty = values.iter().any(|v| v.is_empty());
        if F::dtype() != DType::F32 || empty {
            return values
                .iter()
                .map(|v| {
                    Tensor::from_data(burn::tensor::TensorData::new(v.to_vec(), [v.len()]), device)
                })
                .collect();
        }
        let client = R::client(device);
        let descriptors = values
            .iter()
            .map(|v| {
                (
                    MemoryLayoutDescriptor::new(
                        MemoryLayoutStrategy::Contiguous,
                        [v.len()].into(),
                        std::mem::size_of::<f32>(),
                    ),
                    cubecl::bytes::Bytes::from_elems(v.to_vec()),
                )
            })
            .collect();
        client
            .create_tensors(descriptors)
            .into_iter()
            .zip(values)
            .map(|(layout, v)| {
                let t = burn_cubecl::tensor::CubeTensor::new_contiguous(
                    client.clone(),
                    device.clone(),
                    [v.len()].into(),
                    layout.memory,
                    DType::F32,
                );
                Tensor::from_primitive(TensorPrimitive::Float(t))
            })
            .collect()
    }

    fn fused_elu(x: Tensor<Self, 2>) -> Tensor<Self, 2> {
        activation_on_device(Activation::Elu, x, elu_composed)
    }

    fn fused_elu_backward(y: Tensor<Self, 2>, grad: Tensor<Self, 2>) -> Tensor<Self, 2> {
        activation_backward_on_device(Activation::Elu, y, grad, elu_backward_composed)
    }

    fn fused_sigmoid(x: Tensor<Self, 2>) -> Tensor<Self, 2> {
        activation_on_device(Activation::Sigmoid, x, sigmoid_composed)
    }

    fn fused_sigmoid_backward(s: Tensor<Self, 2>, grad: Tensor<Self, 2>) -> Tensor<Self, 2> {
        activation_backward_on_device(Activation::Sigmoid, s, grad, sigmoid_backward_composed)
    }

    fn spline(
        x: Tensor<Self, 2>,
        raw: Tensor<Self, 2>,
        scale: f64,
        sp: &SplineParams,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        split_spline(Self::spline_kernel_forward(x, raw, scale, sp, None, None))
    }

    const LAYER_KERNELS: bool = true;

    fn activation_half(
        activation: Activation,
        x: Tensor<Self, 2>,
        wide: bool,
    ) -> Option<(Option<Tensor<Self, 2>>, Tensor<Self, 2>)> {
        if x.dtype() != burn::tensor::DType::F32 {
            return None;
        }
        let (y, yh) = crate::activation_kernel::half_forward_launch(activation, prim(x), wide);
        Some((y.map(wrap), wrap(yh)))
    }

    fn activation_half_backward(
        activation: Activation,
        yh: Tensor<Self, 2>,
        grad: Tensor<Self, 2>,
        narrow: bool,
    ) -> Option<Tensor<Self, 2>> {
        use burn::tensor::DType;
        if yh.dtype() != DType::F16 || !matches!(grad.dtype(), DType::F32 | DType::F16) {
            return None;
        }
        let (yh, grad) = (prim(yh), prim(grad));
        let dx = crate::activation_kernel::half_backward_launch(activation, yh, grad, narrow);
        Some(wrap(dx))
    }

    fn coupling_split(
        state: Tensor<Self, 2>,
        ctx: Tensor<Self, 2>,
        start: usize,
    ) -> Tensor<Self, 2> {
        if !all_f32(&[state.dtype(), ctx.dtype()]) {
            return coupling_split_composed(state, ctx, start);
        }
        Self::coupling_split_kernel_forward(state, ctx, start)
    }

    fn coupling_split_kernel_forward(
        state: Tensor<Self, 2>,
        ctx: Tensor<Self, 2>,
        start: usize,
    ) -> Tensor<Self, 2> {
        wrap(crate::coupling_kernel::split_forward_launch(
            prim(state),
            prim(ctx),
            start,
        ))
    }

    fn coupling_split_kernel_backward(
        grad: Tensor<Self, 2>,
        w: usize,
        start: usize,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        let (ds, dc) = crate::coupling_kernel::split_backward_launch(prim(grad), w, start);
        (wrap(ds), wrap(dc))
    }

    fn coupling_place(
        state: Tensor<Self, 2>,
        both: Tensor<Self, 2>,
        start: usize,
    ) -> Tensor<Self, 2> {
        if !all_f32(&[state.dtype(), both.dtype()]) {
            return coupling_place_composed(state, both, start);
        }
        Self::coupling_place_kernel_forward(state, both, start)
    }

    fn coupling_place_kernel_forward(
        state: Tensor<Self, 2>,
        both: Tensor<Self, 2>,
        start: usize,
    ) -> Tensor<Self, 2> {
        wrap(crate::coupling_kernel::place_forward_launch(
            prim(state),
            prim(both),
            start,
        ))
    }

    fn coupling_place_kernel_backward(
        grad: Tensor<Self, 2>,
        start: usize,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        let (ds, db) = crate::coupling_kernel::place_backward_launch(prim(grad), start);
        (wrap(ds), wrap(db))
    }

    fn base_log_prob(state: Tensor<Self, 2>, c: f64, jac: f64) -> Tensor<Self, 1> {
        if !all_f32(&[state.dtype()]) {
            let (z, logdet) = state_parts(state);
            return base_log_prob_composed(z, logdet, c, jac);
        }
        Self::base_log_prob_kernel_forward(state, c, jac)
    }

    fn base_log_prob_kernel_forward(state: Tensor<Self, 2>, c: f64, jac: f64) -> Tensor<Self, 1> {
        wrap(crate::coupling_kernel::base_forward_launch(
            prim(state),
            c,
            jac,
        ))
    }

    fn base_log_prob_kernel_backward(
        state: Tensor<Self, 2>,
        grad: Tensor<Self, 1>,
    ) -> Tensor<Self, 2> {
        wrap(crate::coupling_kernel::base_backward_launch(
            prim(state),
            prim(grad),
        ))
    }

    fn lu_affine(
        lower: Tensor<Self, 1>,
        upper: Tensor<Self, 1>,
        diag: Tensor<Self, 1>,
        bias: Tensor<Self, 1>,
        eps: f64,
        perm: Option<&[usize]>,
    ) -> Tensor<Self, 2> {
        if !all_f32(&[lower.dtype(), upper.dtype(), diag.dtype(), bias.dtype()]) {
            return lu_affine_composed(lower, upper, diag, bias, eps, perm);
        }
        let perm = perm.map(|p| permutation_values(p, &diag.device()));
        Self::lu_affine_kernel_forward(lower, upper, diag, bias, perm, eps)
    }

    fn lu_affine_kernel_forward(
        lower: Tensor<Self, 1>,
        upper: Tensor<Self, 1>,
        diag: Tensor<Self, 1>,
        bias: Tensor<Self, 1>,
        perm: Option<Tensor<Self, 1>>,
        eps: f64,
    ) -> Tensor<Self, 2> {
        wrap(crate::lu_kernel::affine_forward(
            prim(lower),
            prim(upper),
            prim(diag),
            prim(bias),
            perm.map(prim),
            eps,
        ))
    }

    fn lu_affine_kernel_backward(
        lower: Tensor<Self, 1>,
        upper: Tensor<Self, 1>,
        diag: Tensor<Self, 1>,
        perm: Option<Tensor<Self, 1>>,
        da: Tensor<Self, 2>,
        eps: f64,
    ) -> [Tensor<Self, 1>; 4] {
        crate::lu_kernel::affine_backward(
            prim(lower),
            prim(upper),
            prim(diag),
            perm.map(prim),
            prim(da),
            eps,
        )
        .map(wrap)
    }

    fn fused_layer_norm(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        bias: Tensor<Self, 1>,
        eps: f64,
        elu: bool,
    ) -> Tensor<Self, 2> {
        if !all_f32(&[x.dtype(), weight.dtype(), bias.dtype()]) {
            return layer_norm_composed(x, weight, bias, eps, elu);
        }
        Self::layer_norm_kernel_forward(x, weight, bias, eps, elu).0
    }

    fn layer_norm_kernel_forward(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        bias: Tensor<Self, 1>,
        eps: f64,
        elu: bool,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        let (y, stats) = crate::layer_kernel::layer_norm_forward_launch(
            prim(x),
            prim(weight),
            prim(bias),
            eps,
            elu,
        );
        (wrap(y), wrap(stats))
    }

    fn layer_norm_kernel_backward(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        y: Tensor<Self, 2>,
        stats: Tensor<Self, 2>,
        grad: Tensor<Self, 2>,
        elu: bool,
    ) -> (Tensor<Self, 2>, Tensor<Self, 1>, Tensor<Self, 1>) {
        let (dx, dw, db) = crate::layer_kernel::layer_norm_backward_launch(
            prim(x),
            prim(weight),
            prim(y),
            prim(stats),
            prim(grad),
            elu,
        );
        (wrap(dx), wrap(dw), wrap(db))
    }

    fn linear_elu_at(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        weight_f16: Option<Tensor<Self, 1>>,
        bias: Tensor<Self, 1>,
        precision: Precision,
    ) -> Tensor<Self, 2> {
        use burn::tensor::DType;
        match precision {
            Precision::F32 if all_f32(&[x.dtype(), weight.dtype(), bias.dtype()]) => {
                Self::bias_kernel_forward(product(x, weight), bias, true)
            }
            Precision::Half if bias.dtype() == DType::F32 => {
                let h = FloatDType::F16;
                let w = weight_f16.unwrap_or(weight);
                let a = product(x.cast(h), w.cast(h));
                wrap(crate::linear_half_kernel::bias_forward_launch(
                    prim(a),
                    prim(bias),
                    true,
                ))
            }
            _ => Self::elu_at(
                Self::linear_at(x, weight, weight_f16, bias, precision),
                precision,
            ),
        }
    }

    fn linear_residual(
        x: Tensor<Self, 2>,
        t: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        bias: Tensor<Self, 1>,
    ) -> Tensor<Self, 2> {
        if !all_f32(&[x.dtype(), t.dtype(), weight.dtype(), bias.dtype()]) {
            return x + Self::fused_linear(t, weight, bias);
        }
        Self::residual_kernel_forward(x, product(t, weight), bias)
    }

    fn residual_kernel_forward(
        x: Tensor<Self, 2>,
        a: Tensor<Self, 2>,
        bias: Tensor<Self, 1>,
    ) -> Tensor<Self, 2> {
        wrap(crate::layer_kernel::residual_forward_launch(
            prim(x),
            prim(a),
            prim(bias),
        ))
    }

    fn bias_kernel_forward(
        a: Tensor<Self, 2>,
        bias: Tensor<Self, 1>,
        elu: bool,
    ) -> Tensor<Self, 2> {
        wrap(crate::layer_kernel::bias_forward_launch(
            prim(a),
            prim(bias),
            elu,
        ))
    }

    fn bias_kernel_backward(
        y: Tensor<Self, 2>,
        grad: Tensor<Self, 2>,
        elu: bool,
    ) -> (Tensor<Self, 2>, Tensor<Self, 1>) {
        let (da, db) = crate::layer_kernel::bias_backward_launch(prim(y), prim(grad), elu);
        (wrap(da), wrap(db))
    }

    fn linear_at(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        weight_f16: Option<Tensor<Self, 1>>,
        bias: Tensor<Self, 1>,
        precision: Precision,
    ) -> Tensor<Self, 2> {
        let weight = match precision {
            Precision::F32 => return Self::fused_linear(x, weight, bias),
            Precision::Half => weight_f16.unwrap_or(weight),
        };
        if bias.dtype() != burn::tensor::DType::F32 {
            return linear_half(x, weight, bias);
        }
        let h = FloatDType::F16;
        let a = product(x.cast(h), weight.cast(h));
        wrap(crate::linear_half_kernel::bias_forward_launch(
            prim(a),
            prim(bias),
            false,
        ))
    }

    fn linear_backward_at(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        grad: Tensor<Self, 2>,
        need: [bool; 3],
        precision: Precision,
    ) -> LinearGradients<Self> {
        match precision {
            Precision::F32 => Self::fused_linear_backward(x, weight, grad, need),
            Precision::Half
                if matches!(
                    grad.dtype(),
                    burn::tensor::DType::F32 | burn::tensor::DType::F16
                ) =>
            {
                // A float16 gradient (written so by the kernel before) needs no cast.
                let h = FloatDType::F16;
                let (x, w, g) = (x.cast(h), weight.cast(h), grad.cast(h));
                // The float16 products; the bias gradient and the casts are the kernel's.
                let (dxh, dwh, _) =
                    linear_backward_composed(x, w, g.clone(), [need[0], need[1], false]);
                let (dx, dw, db) = crate::linear_half_kernel::gradients_launch(
                    dxh.map(prim),
                    dwh.map(prim),
                    prim(g),
                );
                (dx.map(wrap), dw.map(wrap), need[2].then(|| wrap(db)))
            }
            Precision::Half => linear_backward_half(x, weight, grad, need),
        }
    }

    fn gated_residual(
        x: Tensor<Self, 2>,
        t: Tensor<Self, 2>,
        w1: Tensor<Self, 1>,
        w1_f16: Option<Tensor<Self, 1>>,
        b1: Tensor<Self, 1>,
        context: Tensor<Self, 2>,
        wc: Tensor<Self, 1>,
        bc: Tensor<Self, 1>,
        precision: Precision,
    ) -> Tensor<Self, 2> {
        let others = [x.dtype(), w1.dtype(), b1.dtype(), context.dtype()];
        if !gated_kernel_takes(t.dtype(), &others, [wc.dtype(), bc.dtype()], precision) {
            let w1 = (w1, w1_f16);
            return gated_composed(x, t, w1, b1, context, wc, bc, precision);
        }
        let (a, _, _) = gated_product(t, w1, w1_f16, precision);
        Self::gated_kernel_forward(x, a, b1, context, wc, bc).0
    }

    fn gated_kernel_forward(
        x: Tensor<Self, 2>,
        a: Tensor<Self, 2>,
        b1: Tensor<Self, 1>,
        context: Tensor<Self, 2>,
        wc: Tensor<Self, 1>,
        bc: Tensor<Self, 1>,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        let (y, s) = crate::layer_kernel::gated_forward_launch(
            prim(x),
            prim(a),
            prim(b1),
            prim(context),
            prim(wc),
            prim(bc),
        );
        (wrap(y), wrap(s))
    }

    fn gated_kernel_backward(
        a: Tensor<Self, 2>,
        b1: Tensor<Self, 1>,
        s: Tensor<Self, 2>,
        context: Tensor<Self, 2>,
        wc: Tensor<Self, 1>,
        grad: Tensor<Self, 2>,
    ) -> GatedGradients<Self> {
        let [da, dctx, dwc, db1, dbc] = crate::layer_kernel::gated_backward_launch(
            prim(a),
            prim(b1),
            prim(s),
            prim(context),
            prim(wc),
            prim(grad),
        );
        (wrap(da), wrap(dctx), wrap(dwc), wrap(db1), wrap(dbc))
    }

    fn spline_kernel_forward(
        x: Tensor<Self, 2>,
        raw: Tensor<Self, 2>,
        scale: f64,
        sp: &SplineParams,
        state_start: Option<usize>,
        bias: Option<Tensor<Self, 1>>,
    ) -> Tensor<Self, 2> {
        let out = crate::spline_kernel::forward(
            x.into_primitive().tensor(),
            raw.into_primitive().tensor(),
            scale,
            sp,
            state_start,
            bias.map(prim),
        );
        Tensor::from_primitive(TensorPrimitive::Float(out))
    }

    fn device_optimizer() -> bool {
        F::dtype() == burn::tensor::DType::F32
    }

    fn view(buffer: &Tensor<Self, 1>, offset: usize, len: usize) -> Tensor<Self, 1> {
        let t = prim(buffer.clone());
        let size = t.dtype.size();
        let used = t.handle.size_in_used() as usize;
        let (start, bytes) = (size * offset, size * len);
        assert!(
            start + bytes <= used && start.is_multiple_of(256),
            "a view of {len} values at {offset} does not fit an aligned buffer of {} values",
            used / size
        );
        let handle = t
            .handle
            .clone()
            .offset_start(start as u64)
            .offset_end((used - start - bytes) as u64);
        wrap(burn_cubecl::tensor::CubeTensor::new_contiguous(
            t.client.clone(),
            t.device.clone(),
            [len].into(),
            handle,
            t.dtype,
        ))
    }

    fn pack_many_into(srcs: Vec<(Tensor<Self, 1>, usize)>, dst: &Tensor<Self, 1>, add: bool) {
        let srcs = srcs.into_iter().map(|(t, o)| (prim(t), o)).collect();
        crate::optim_kernel::pack_many_launch(srcs, &prim(dst.clone()), add);
    }

    fn zero_into(dst: &Tensor<Self, 1>) {
        crate::optim_kernel::zero_launch(&prim(dst.clone()));
    }

    fn non_finite_flag(g: &Tensor<Self, 1>) -> Tensor<Self, 1> {
        let flag = Tensor::<Self, 1>::from_data(
            burn::tensor::TensorData::new(vec![0.0f32], [1]),
            &g.device(),
        );
        crate::optim_kernel::non_finite_launch(&prim(g.clone()), &prim(flag.clone()));
        flag
    }

    fn optimizer_update(
        params: &Tensor<Self, 1>,
        slots: &[Tensor<Self, 1>],
        grad: &Tensor<Self, 1>,
        update: &lockstep_train::DeviceUpdate,
    ) {
        let slots: Vec<_> = slots.iter().map(|t| prim(t.clone())).collect();
        crate::optim_kernel::update_launch(
            &prim(params.clone()),
            &slots,
            &prim(grad.clone()),
            update,
        );
    }

    fn spline_kernel_backward(
        x: Tensor<Self, 2>,
        raw: Tensor<Self, 2>,
        grad: Tensor<Self, 2>,
        scale: f64,
        sp: &SplineParams,
        state_start: Option<usize>,
        bias: Option<Tensor<Self, 1>>,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        let (dx, draw) = crate::spline_kernel::backward(
            x.into_primitive().tensor(),
            raw.into_primitive().tensor(),
            grad.into_primitive().tensor(),
            scale,
            sp,
            state_start,
            bias.map(prim),
        );
        (
            Tensor::from_primitive(TensorPrimitive::Float(dx)),
            Tensor::from_primitive(TensorPrimitive::Float(draw)),
        )
    }
}

/// Whether every dtype is float32 (what the layer kernels take).
fn all_f32(dtypes: &[burn::tensor::DType]) -> bool {
    dtypes.iter().all(|d| *d == burn::tensor::DType::F32)
}

/// Whether the gated tail's kernel path takes operands of these dtypes: float32, but for
/// the block's input `t`, which mixed precision may hand over in float16 (an ELU's output,
/// read by the float16 product as it is).
fn gated_kernel_takes(
    t: burn::tensor::DType,
    others: &[burn::tensor::DType],
    context_layer: [burn::tensor::DType; 2],
    precision: Precision,
) -> bool {
    let t_fits = t == burn::tensor::DType::F32
        || (precision == Precision::Half && t == burn::tensor::DType::F16);
    t_fits && all_f32(others) && all_f32(&context_layer)
}

/// The float primitive of a tensor.
fn prim<B: Backend, const D: usize>(t: Tensor<B, D>) -> B::FloatTensorPrimitive {
    t.into_primitive().tensor()
}

/// A tensor of a float primitive.
fn wrap<B: Backend, const D: usize>(t: B::FloatTensorPrimitive) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// A `[rows, cols]` tensor of a CubeCL backend.
type CubeMatrix<R, F, I, BT> = Tensor<burn_cubecl::CubeBackend<R, F, I, BT>, 2>;

/// An activation on a CubeCL backend: one kernel ([`crate::activation_kernel`]) for
/// float32 and float16 (mixed precision), `composed` for another dtype.
fn activation_on_device<R, F, I, BT, C>(
    activation: Activation,
    x: CubeMatrix<R, F, I, BT>,
    composed: C,
) -> CubeMatrix<R, F, I, BT>
where
    C: FnOnce(CubeMatrix<R, F, I, BT>) -> CubeMatrix<R, F, I, BT>,
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
    if !crate::activation_kernel::supports_dtype(x.dtype()) {
        return composed(x);
    }
    let y = crate::activation_kernel::forward(activation, x.into_primitive().tensor());
    Tensor::from_primitive(TensorPrimitive::Float(y))
}

/// An activation's gradient on a CubeCL backend from its output `y` and the incoming
/// `grad`: one kernel for float32 or float16 (both of one dtype), `composed` otherwise.
fn activation_backward_on_device<R, F, I, BT, C>(
    activation: Activation,
    y: CubeMatrix<R, F, I, BT>,
    grad: CubeMatrix<R, F, I, BT>,
    composed: C,
) -> CubeMatrix<R, F, I, BT>
where
    C: FnOnce(CubeMatrix<R, F, I, BT>, CubeMatrix<R, F, I, BT>) -> CubeMatrix<R, F, I, BT>,
    R: burn_cubecl::CubeRuntime,
    F: burn_cubecl::FloatElement,
    I: burn_cubecl::IntElement,
    BT: burn_cubecl::BoolElement,
{
    if !crate::activation_kernel::supports_dtype(y.dtype()) || y.dtype() != grad.dtype() {
        return composed(y, grad);
    }
    let dx = crate::activation_kernel::backward(
        activation,
        y.into_primitive().tensor(),
        grad.into_primitive().tensor(),
    );
    Tensor::from_primitive(TensorPrimitive::Float(dx))
}

impl FusedOps for NdArray<f32> {
    const HOST_MEMORY: bool = true;

    fn fused_linear(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        bias: Tensor<Self, 1>,
    ) -> Tensor<Self, 2> {
        let (xp, wp, bp) = (f32_array(&x), f32_array(&weight), f32_array(&bias));
        let (Some(xa), Some(wa), Some(ba)) = (xp, wp, bp) else {
            return linear_composed(x, weight, bias);
        };
        let (Some(x2), Some(b1)) = (view2(&xa), view1(&ba)) else {
            return linear_composed(x, weight, bias);
        };
        let (m, k) = x2.dim();
        let n = b1.len();
        let Some(w2) = matrix(&wa, n, k) else {
            return linear_composed(x, weight, bias);
        };
        let mut out = Array2::from_shape_fn((m, n), |(_, j)| b1[j]);
        general_mat_mul(1.0, &x2, &w2.t(), 1.0, &mut out);
        from_array(out.into_dyn().into_shared())
    }

    fn fused_linear_backward(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        grad: Tensor<Self, 2>,
        need: [bool; 3],
    ) -> LinearGradients<Self> {
        let (xp, wp, gp) = (f32_array(&x), f32_array(&weight), f32_array(&grad));
        let (Some(xa), Some(wa), Some(ga)) = (xp, wp, gp) else {
            return linear_backward_composed(x, weight, grad, need);
        };
        let (Some(x2), Some(g2)) = (view2(&xa), view2(&ga)) else {
            return linear_backward_composed(x, weight, grad, need);
        };
        let (m, k) = x2.dim();
        let n = g2.dim().1;
        let Some(w2) = matrix(&wa, n, k) else {
            return linear_backward_composed(x, weight, grad, need);
        };
        let dx = need[0].then(|| {
            let mut dx = Array2::<f32>::zeros((m, k));
            general_mat_mul(1.0, &g2, &w2, 0.0, &mut dx);
            from_array(dx.into_dyn().into_shared())
        });
        let dw = need[1].then(|| {
            let mut dw = Array2::<f32>::zeros((n, k));
            general_mat_mul(1.0, &g2.t(), &x2, 0.0, &mut dw);
            from_array(
                dw.into_shape_with_order(n * k)
                    .expect("contiguous")
                    .into_dyn()
                    .into_shared(),
            )
        });
        let db = need[2].then(|| from_array(g2.sum_axis(Axis(0)).into_dyn().into_shared()));
        (dx, dw, db)
    }

    fn fused_elu(x: Tensor<Self, 2>) -> Tensor<Self, 2> {
        map_f32(x, elu_slice, elu_composed)
    }

    fn fused_elu_backward(y: Tensor<Self, 2>, grad: Tensor<Self, 2>) -> Tensor<Self, 2> {
        zip_f32(y, grad, elu_backward_slice, elu_backward_composed)
    }

    fn fused_sigmoid(x: Tensor<Self, 2>) -> Tensor<Self, 2> {
        map_f32(x, sigmoid_slice, sigmoid_composed)
    }

    fn fused_sigmoid_backward(s: Tensor<Self, 2>, grad: Tensor<Self, 2>) -> Tensor<Self, 2> {
        zip_f32(s, grad, sigmoid_backward_slice, sigmoid_backward_composed)
    }
}

/// The f32 array of an ndarray tensor (shares the data; `None` for another dtype).
fn f32_array<const D: usize>(
    t: &Tensor<NdArray<f32>, D>,
) -> Option<ndarray::ArcArray<f32, ndarray::IxDyn>> {
    match t.clone().into_primitive().tensor() {
        NdArrayTensor::F32(storage) => Some(storage.into_owned()),
        _ => None,
    }
}

fn view2(a: &ndarray::ArcArray<f32, ndarray::IxDyn>) -> Option<ArrayView2<'_, f32>> {
    a.view().into_dimensionality::<Ix2>().ok()
}

fn view1(a: &ndarray::ArcArray<f32, ndarray::IxDyn>) -> Option<ArrayView1<'_, f32>> {
    a.view().into_dimensionality::<Ix1>().ok()
}

/// A flat contiguous `[rows * cols]` array as a row-major `[rows, cols]` view.
fn matrix(
    a: &ndarray::ArcArray<f32, ndarray::IxDyn>,
    rows: usize,
    cols: usize,
) -> Option<ArrayView2<'_, f32>> {
    ArrayView2::from_shape((rows, cols), a.as_slice()?).ok()
}

fn from_array<const D: usize>(
    a: ndarray::ArcArray<f32, ndarray::IxDyn>,
) -> Tensor<NdArray<f32>, D> {
    Tensor::from_primitive(TensorPrimitive::Float(NdArrayTensor::from(a)))
}

/// Applies `kernel` in place to the f32 values of `x` (copied first when shared or not
/// contiguous); tensors of another dtype take `composed`.
fn map_f32(
    x: Tensor<NdArray<f32>, 2>,
    kernel: fn(&mut [f32]),
    composed: fn(Tensor<NdArray<f32>, 2>) -> Tensor<NdArray<f32>, 2>,
) -> Tensor<NdArray<f32>, 2> {
    match x.into_primitive().tensor() {
        NdArrayTensor::F32(storage) => {
            let mut a = storage.into_owned();
            if a.as_slice_memory_order_mut().is_none() {
                a = a.as_standard_layout().into_owned().into_shared();
            }
            // `as_slice_memory_order_mut` makes the data unique (copy on write) and, after
            // the line above, the array is contiguous.
            if let Some(values) = a.as_slice_memory_order_mut() {
                kernel(values);
            }
            Tensor::from_primitive(TensorPrimitive::Float(NdArrayTensor::from(a)))
        }
        other => composed(Tensor::from_primitive(TensorPrimitive::Float(other))),
    }
}

/// A 2-D f32 tensor on the ndarray backend.
type Nd2 = Tensor<NdArray<f32>, 2>;

/// Applies `kernel(grad, y)` with `grad` updated in place, when both are f32 tensors of the
/// same shape and memory order; otherwise `composed`.
fn zip_f32(
    y: Tensor<NdArray<f32>, 2>,
    grad: Tensor<NdArray<f32>, 2>,
    kernel: fn(&mut [f32], &[f32]),
    composed: fn(Nd2, Nd2) -> Nd2,
) -> Tensor<NdArray<f32>, 2> {
    let wrap =
        |t: NdArrayTensor| Tensor::<NdArray<f32>, 2>::from_primitive(TensorPrimitive::Float(t));
    match (y.into_primitive().tensor(), grad.into_primitive().tensor()) {
        (NdArrayTensor::F32(ys), NdArrayTensor::F32(gs)) => {
            // `y` is read in place (no copy) when contiguous; `g` is updated in place.
            let y = ys.into_owned();
            let mut g = gs.into_owned();
            if g.shape() == y.shape() && g.is_standard_layout() {
                if let (Some(gv), Some(yv)) = (g.as_slice_memory_order_mut(), y.as_slice()) {
                    kernel(gv, yv);
                    return wrap(NdArrayTensor::from(g));
                }
            }
            composed(wrap(NdArrayTensor::from(y)), wrap(NdArrayTensor::from(g)))
        }
        (y, g) => composed(wrap(y), wrap(g)),
    }
}

/// `e^x` in f32 without libm: Cephes `expf` (range reduction `x = n ln 2 + r` with `ln 2`
/// split in two, a degree-7 polynomial on `|r| <= ln 2 / 2`, scaling by `2^n` through the
/// exponent bits). Relative error below 3e-7 (a few ulp) for `x` in `[-87.3, 88.3]`; inputs
/// are clamped to that range (so `e^x` never overflows to infinity or underflows below the
/// smallest normal float); NaN stays NaN. Only IEEE additions and multiplications, no
/// branches: loops over it vectorize, and every CPU gives the same bits.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    // 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits.
    const SHIFT: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    let x = x.clamp(-87.3, 88.3);
    let k = x * std::f32::consts::LOG2_E + SHIFT;
    let n = k - SHIFT;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r
        + 1.666_666_5e-1)
        * r
        + 0.5;
    let e = p * (r * r) + r + 1.0;
    // n in [-126, 127]: the biased exponent n + 127 is in [1, 254].
    let n_bits = k.to_bits().wrapping_sub(SHIFT.to_bits());
    e * f32::from_bits(n_bits.wrapping_add(127) << 23)
}

#[inline(always)]
fn elu_one(x: f32) -> f32 {
    if x > 0.0 {
        x
    } else {
        exp_f32(x) - 1.0
    }
}

#[inline(always)]
fn sigmoid_one(x: f32) -> f32 {
    1.0 / (1.0 + exp_f32(-x))
}

macro_rules! dispatched {
    ($(#[$doc:meta])* $name:ident, $avx:ident, ($($arg:ident: $ty:ty),*), $body:expr) => {
        $(#[$doc])*
        fn $name($($arg: $ty),*) {
            #[cfg(target_arch = "x86_64")]
            if std::is_x86_feature_detected!("avx2") {
                // SAFETY: the CPU has AVX2 (checked at run time).
                return unsafe { $avx($($arg),*) };
            }
            $body
        }

        /// The same loop compiled for AVX2 (same IEEE operations, so the same bits).
        ///
        /// # Safety
        /// The CPU must support AVX2.
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = "avx2")]
        unsafe fn $avx($($arg: $ty),*) {
            $body
        }
    };
}

dispatched!(
    /// ELU in place.
    elu_slice, elu_slice_avx2, (v: &mut [f32]),
    v.iter_mut().for_each(|x| *x = elu_one(*x))
);

dispatched!(
    /// sigmoid in place.
    sigmoid_slice, sigmoid_slice_avx2, (v: &mut [f32]),
    v.iter_mut().for_each(|x| *x = sigmoid_one(*x))
);

dispatched!(
    /// `g *= (y > 0 ? 1 : y + 1)`.
    elu_backward_slice, elu_backward_slice_avx2, (g: &mut [f32], y: &[f32]),
    g.iter_mut()
        .zip(y)
        .for_each(|(g, &y)| *g *= if y > 0.0 { 1.0 } else { y + 1.0 })
);

dispatched!(
    /// `g *= s (1 - s)`.
    sigmoid_backward_slice, sigmoid_backward_slice_avx2, (g: &mut [f32], s: &[f32]),
    g.iter_mut().zip(s).for_each(|(g, &s)| *g = *g * s * (1.0 - s))
);

/// The backward step of a fused activation on `Autodiff<B>`: `gradient(output, grad)`
/// ([`FusedOps::fused_elu_backward`], [`FusedOps::fused_sigmoid_backward`]); its state is
/// the output.
#[derive(Debug)]
struct ActivationBackward<B: Backend> {
    kind: Activation,
    gradient: fn(Tensor<B, 2>, Tensor<B, 2>) -> Tensor<B, 2>,
    precision: Precision,
}

impl<B: FusedOps> Backward<B, 1> for ActivationBackward<B> {
    type State = Tensor<B, 2>;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [parent] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        if let Some(parent) = parent {
            let g = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(g));
            let dx = match self.precision {
                Precision::F32 => (self.gradient)(ops.state, g),
                Precision::Half => {
                    let (yh, gh) = (ops.state.clone(), g.clone());
                    match B::activation_half_backward(self.kind, yh, gh, false) {
                        Some(dx) => dx,
                        None => in_half2(ops.state, g, self.gradient),
                    }
                }
            };
            grads.register::<B>(parent.id, dx.into_primitive().tensor());
        }
    }
}

/// The backward step of [`FusedOps::fused_linear`] on `Autodiff<B>`; its state is the
/// input and the flat weight.
#[derive(Debug)]
struct LinearBackward {
    precision: Precision,
}

impl<B: FusedOps> Backward<B, 3> for LinearBackward {
    type State = (Tensor<B, 2>, Tensor<B, 1>);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [px, pw, pb] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        let g = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(g));
        let (x, w) = ops.state;
        let need = [px.is_some(), pw.is_some(), pb.is_some()];
        let (dx, dw, db) = B::linear_backward_at(x, w, g, need, self.precision);
        if let (Some(p), Some(d)) = (px, dx) {
            grads.register::<B>(p.id, d.into_primitive().tensor());
        }
        if let (Some(p), Some(d)) = (pw, dw) {
            grads.register::<B>(p.id, d.into_primitive().tensor());
        }
        if let (Some(p), Some(d)) = (pb, db) {
            grads.register::<B>(p.id, d.into_primitive().tensor());
        }
    }
}

/// The backward step of [`FusedOps::spline`] on `Autodiff<B>` for a backend with the
/// spline kernels; its state is `x` and `raw`.
#[derive(Debug)]
struct SplineBackward {
    scale: f64,
    sp: SplineParams,
    state_start: Option<usize>,
}

impl<B: FusedOps> Backward<B, 2> for SplineBackward {
    type State = (Tensor<B, 2>, Tensor<B, 2>);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [px, praw] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        let g = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(g));
        let (x, raw) = ops.state;
        let (dx, draw) =
            B::spline_kernel_backward(x, raw, g, self.scale, &self.sp, self.state_start, None);
        if let Some(p) = px {
            grads.register::<B>(p.id, dx.into_primitive().tensor());
        }
        if let Some(p) = praw {
            grads.register::<B>(p.id, draw.into_primitive().tensor());
        }
    }
}

/// The backward step of [`FusedOps::spline_joint`] with the final layer's bias on
/// `Autodiff<B>` (parents `x`, `raw`, `bias`); its state is the three.
#[derive(Debug)]
struct SplineBiasBackward {
    scale: f64,
    sp: SplineParams,
    state_start: Option<usize>,
}

impl<B: FusedOps> Backward<B, 3> for SplineBiasBackward {
    type State = (Tensor<B, 2>, Tensor<B, 2>, Tensor<B, 1>);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [px, praw, pbias] = ops.parents;
        let g = wrap::<B, 2>(grads.consume::<B>(&ops.node));
        let (x, raw, bias) = ops.state;
        let len = bias.dims()[0];
        let (dx, draw) = B::spline_kernel_backward(
            x,
            raw,
            g,
            self.scale,
            &self.sp,
            self.state_start,
            Some(bias),
        );
        let db = pbias.is_some().then(|| {
            let [m, width] = draw.dims();
            draw.clone()
                .reshape([m * width / len, len])
                .sum_dim(0)
                .reshape([len])
        });
        register!(grads; (px, Some(dx)), (praw, Some(draw)), (pbias, db));
    }
}

/// The backward step of [`FusedOps::fused_layer_norm`] on `Autodiff<B>` for a backend with the
/// layer kernels; its state is the input, the scale, the output and the row statistics.
#[derive(Debug)]
struct LayerNormBackward {
    elu: bool,
}

/// The inner-backend tensors a LayerNorm node keeps: `(x, weight, y, stats)`.
type LayerNormState<B> = (Tensor<B, 2>, Tensor<B, 1>, Tensor<B, 2>, Tensor<B, 2>);

impl<B: FusedOps> Backward<B, 3> for LayerNormBackward {
    type State = LayerNormState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [px, pw, pb] = ops.parents;
        let g = wrap::<B, 2>(grads.consume::<B>(&ops.node));
        let (x, w, y, stats) = ops.state;
        let (dx, dw, db) = B::layer_norm_kernel_backward(x, w, y, stats, g, self.elu);
        if let Some(p) = px {
            grads.register::<B>(p.id, prim(dx));
        }
        for (p, d) in [(pw, dw), (pb, db)] {
            if let Some(p) = p {
                grads.register::<B>(p.id, prim(d));
            }
        }
    }
}

/// The backward step of [`FusedOps::linear_elu_at`] on `Autodiff<B>` for a backend with the
/// layer kernels; its state is the input, the flat weight and the output (at
/// [`Precision::Half`] the float16 ones).
#[derive(Debug)]
struct LinearEluBackward {
    precision: Precision,
}

impl<B: FusedOps> Backward<B, 3> for LinearEluBackward {
    type State = (Tensor<B, 2>, Tensor<B, 1>, Tensor<B, 2>);

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [px, pw, pb] = ops.parents;
        let g = wrap::<B, 2>(grads.consume::<B>(&ops.node));
        let (x, w, y) = ops.state;
        let need = [px.is_some(), pw.is_some(), false];
        let (dx, dw, db) = match self.precision {
            Precision::F32 => {
                let (da, db) = B::bias_kernel_backward(y, g, true);
                let (dx, dw, _) = linear_backward_composed(x, w, da, need);
                (dx, dw, db)
            }
            Precision::Half => {
                // The ELU's gradient in float16 (one kernel, written as the float16 products
                // read it), then the products and one kernel for the float32 gradients
                // and the bias's.
                let da = B::activation_half_backward(Activation::Elu, y.clone(), g.clone(), true)
                    .unwrap_or_else(|| B::fused_elu_backward(y, g.cast(FloatDType::F16)));
                let need = [need[0], need[1], true];
                let (dx, dw, db) = B::linear_backward_at(x, w, da, need, Precision::Half);
                (dx, dw, db.expect("the bias's gradient, asked for"))
            }
        };
        if let (Some(p), Some(d)) = (px, dx) {
            grads.register::<B>(p.id, prim(d));
        }
        if let (Some(p), Some(d)) = (pw, dw) {
            grads.register::<B>(p.id, prim(d));
        }
        if let Some(p) = pb {
            grads.register::<B>(p.id, prim(db));
        }
    }
}

/// The backward step of [`FusedOps::linear_product`] on `Autodiff<B>` (parents `x`,
/// `weight`); its state is the two.
#[derive(Debug)]
struct LinearProductBackward;

impl<B: FusedOps> Backward<B, 2> for LinearProductBackward {
    type State = (Tensor<B, 2>, Tensor<B, 1>);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [px, pw] = ops.parents;
        let g = wrap::<B, 2>(grads.consume::<B>(&ops.node));
        let (x, w) = ops.state;
        let (dx, dw, _) = linear_backward_composed(x, w, g, [px.is_some(), pw.is_some(), false]);
        register!(grads; (px, dx), (pw, dw));
    }
}

/// The backward step of [`FusedOps::linear_residual`] on `Autodiff<B>` for a backend with
/// the layer kernels (parents `x, t, weight, bias`); its state is `t` and the weight.
#[derive(Debug)]
struct LinearResidualBackward;

impl<B: FusedOps> Backward<B, 4> for LinearResidualBackward {
    type State = (Tensor<B, 2>, Tensor<B, 1>);

    fn backward(
        self,
        ops: Ops<Self::State, 4>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [px, pt, pw, pb] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        let (t, w) = ops.state;
        let need = [pt.is_some(), pw.is_some(), pb.is_some()];
        let (dt, dw, db) = linear_backward_composed(t, w, wrap::<B, 2>(g.clone()), need);
        if let Some(p) = px {
            grads.register::<B>(p.id, g);
        }
        register!(grads; (pt, dt), (pw, dw), (pb, db));
    }
}

/// The backward step of [`FusedOps::gated_residual`] on `Autodiff<B>` for a backend with
/// the layer kernels (parents `x, t, w1, b1, context, wc, bc`); its state is `t`, `w1`,
/// `b1`, `context`, `wc`, `bc` and the two products `a = t W₁ᵀ`, `c = context W_cᵀ`.
#[derive(Debug)]
struct GatedBackward {
    precision: Precision,
}

/// The inner-backend tensors a gated tail's node keeps (see [`GatedBackward`]).
#[derive(Debug, Clone)]
struct GatedState<B: Backend> {
    t: Tensor<B, 2>,
    w1: Tensor<B, 1>,
    b1: Tensor<B, 1>,
    context: Tensor<B, 2>,
    wc: Tensor<B, 1>,
    a: Tensor<B, 2>,
    s: Tensor<B, 2>,
}

impl<B: FusedOps> Backward<B, 7> for GatedBackward {
    type State = GatedState<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 7>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [px, pt, pw1, pb1, pctx, pwc, pbc] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        let s = ops.state;
        let (da, dctx, dwc, db1, dbc) =
            B::gated_kernel_backward(s.a, s.b1, s.s, s.context, s.wc, wrap::<B, 2>(g.clone()));
        if let Some(p) = px {
            grads.register::<B>(p.id, g);
        }
        let need = [pt.is_some(), pw1.is_some(), false];
        let (dt, dw1, _) = match self.precision {
            Precision::F32 => linear_backward_composed(s.t, s.w1, da, need),
            Precision::Half => B::linear_backward_at(s.t, s.w1, da, need, Precision::Half),
        };
        register!(grads; (pt, dt), (pctx, Some(dctx)), (pw1, dw1), (pwc, Some(dwc)));
        register!(grads; (pb1, Some(db1)), (pbc, Some(dbc)));
    }
}

/// The backward step of [`FusedOps::lu_affine`] on `Autodiff<B>` for a backend with the
/// layer kernels (parents `lower`, `upper`, `diag`, `bias`); its state is the first three
/// and the permutation's values.
#[derive(Debug)]
struct LuAffineBackward {
    eps: f64,
}

impl<B: FusedOps> Backward<B, 4> for LuAffineBackward {
    type State = (
        Tensor<B, 1>,
        Tensor<B, 1>,
        Tensor<B, 1>,
        Option<Tensor<B, 1>>,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 4>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let g = wrap::<B, 2>(grads.consume::<B>(&ops.node));
        let (lower, upper, diag, perm) = ops.state;
        let d = B::lu_affine_kernel_backward(lower, upper, diag, perm, g, self.eps);
        for (p, d) in ops.parents.into_iter().zip(d) {
            if let Some(p) = p {
                grads.register::<B>(p.id, prim(d));
            }
        }
    }
}

/// The backward step of [`FusedOps::coupling_split`] on `Autodiff<B>` for a backend with
/// the layer kernels (parents `state`, `ctx`); stateless.
#[derive(Debug)]
struct SplitBackward {
    w: usize,
    start: usize,
}

impl<B: FusedOps> Backward<B, 2> for SplitBackward {
    type State = ();

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [ps, pc] = ops.parents;
        let g = wrap::<B, 2>(grads.consume::<B>(&ops.node));
        let (ds, dc) = B::coupling_split_kernel_backward(g, self.w, self.start);
        register!(grads; (ps, Some(ds)), (pc, Some(dc)));
    }
}

/// The backward step of [`FusedOps::coupling_place`] on `Autodiff<B>` for a backend with
/// the layer kernels (parents `state`, `both`); stateless.
#[derive(Debug)]
struct PlaceBackward {
    start: usize,
}

impl<B: FusedOps> Backward<B, 2> for PlaceBackward {
    type State = ();

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [ps, pboth] = ops.parents;
        let g = wrap::<B, 2>(grads.consume::<B>(&ops.node));
        let (ds, dboth) = B::coupling_place_kernel_backward(g, self.start);
        register!(grads; (ps, Some(ds)), (pboth, Some(dboth)));
    }
}

/// The backward step of [`FusedOps::scale_gradient`] on `Autodiff<B>` (parent `x`).
#[derive(Debug)]
struct ScaleGradientBackward {
    factor: f64,
}

impl<B: FusedOps> Backward<B, 1> for ScaleGradientBackward {
    type State = ();

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [px] = ops.parents;
        let g = wrap::<B, 1>(grads.consume::<B>(&ops.node));
        if let Some(p) = px {
            grads.register::<B>(p.id, prim(g.mul_scalar(self.factor)));
        }
    }
}

/// The backward step of [`FusedOps::base_log_prob`] on `Autodiff<B>` for a backend with the
/// layer kernels (parent `state`); its state is the flow state.
#[derive(Debug)]
struct BaseLogProbBackward;

impl<B: FusedOps> Backward<B, 1> for BaseLogProbBackward {
    type State = Tensor<B, 2>;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [ps] = ops.parents;
        let g = grads.consume::<B>(&ops.node);
        if let Some(p) = ps {
            let d = B::base_log_prob_kernel_backward(ops.state, wrap(g));
            grads.register::<B>(p.id, prim(d));
        }
    }
}

/// Records `forward` (an inner-backend activation) as one autodiff node whose backward step
/// keeps the output and applies `gradient(output, grad)`. At [`Precision::Half`] the output
/// is float32 when `wide`, else the float16 values themselves.
fn activation<B: FusedOps, C: CheckpointStrategy>(
    kind: Activation,
    x: Tensor<Autodiff<B, C>, 2>,
    forward: fn(Tensor<B, 2>) -> Tensor<B, 2>,
    gradient: fn(Tensor<B, 2>, Tensor<B, 2>) -> Tensor<B, 2>,
    (precision, wide): (Precision, bool),
) -> Tensor<Autodiff<B, C>, 2> {
    let x = x.into_primitive().tensor();
    let xi = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(x.primitive.clone()));
    // The state is the output as computed: in mixed precision its float16 values, so the
    // backward step does not cast it again (casting float16 to float32 and back is exact).
    let (y, state) = match precision {
        Precision::F32 => {
            let y = forward(xi);
            (y.clone(), y)
        }
        Precision::Half => match B::activation_half(kind, xi.clone(), wide) {
            Some((Some(y), yh)) => (y, yh),
            Some((None, yh)) => (yh.clone(), yh),
            None => {
                let dtype = xi.dtype();
                let yh = forward(xi.cast(FloatDType::F16));
                let y = if wide {
                    yh.clone().cast(dtype)
                } else {
                    yh.clone()
                };
                (y, yh)
            }
        },
    };
    let output = y.into_primitive().tensor();
    let tracked = match (ActivationBackward {
        kind,
        gradient,
        precision,
    })
    .prepare::<C>([x.node.clone()])
    .compute_bound()
    .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(state, output),
        OpsKind::UnTracked(prep) => prep.finish(output),
    };
    Tensor::from_primitive(TensorPrimitive::Float(tracked))
}

impl<B: FusedOps, C: CheckpointStrategy> FusedOps for Autodiff<B, C> {
    fn scale_gradient(x: Tensor<Self, 1>, factor: f64) -> Tensor<Self, 1> {
        let xp = prim(x);
        let output = xp.primitive.clone();
        let tracked = match (ScaleGradientBackward { factor })
            .prepare::<C>([xp.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((), output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        };
        wrap(tracked)
    }

    const HOST_MEMORY: bool = B::HOST_MEMORY;
    const SPLINE_KERNEL: bool = B::SPLINE_KERNEL;

    fn fused_linear(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        bias: Tensor<Self, 1>,
    ) -> Tensor<Self, 2> {
        Self::linear_at(x, weight, None, bias, Precision::F32)
    }

    fn linear_at(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        weight_f16: Option<Tensor<Self, 1>>,
        bias: Tensor<Self, 1>,
        precision: Precision,
    ) -> Tensor<Self, 2> {
        let x = x.into_primitive().tensor();
        let w = weight.into_primitive().tensor();
        let b = bias.into_primitive().tensor();
        let xi = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(x.primitive.clone()));
        let wi = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(w.primitive.clone()));
        let bi = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(b.primitive.clone()));
        // In mixed precision the backward step keeps the float16 casts of the input and the
        // weight (as autocast saves them): its own casts of them are then no-ops. A float16
        // input (an ELU's output) and the pass's float16 weight copy need no cast.
        let (xi, wi) = match precision {
            Precision::F32 => (xi, wi),
            Precision::Half => (
                xi.cast(FloatDType::F16),
                weight_f16.map_or(wi, |w| w.inner()).cast(FloatDType::F16),
            ),
        };
        let y = B::linear_at(xi.clone(), wi.clone(), None, bi, precision);
        let output = y.into_primitive().tensor();
        let tracked = match (LinearBackward { precision })
            .prepare::<C>([x.node.clone(), w.node.clone(), b.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((xi, wi), output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        };
        Tensor::from_primitive(TensorPrimitive::Float(tracked))
    }

    fn fused_elu(x: Tensor<Self, 2>) -> Tensor<Self, 2> {
        Self::elu_at(x, Precision::F32)
    }

    fn spline(
        x: Tensor<Self, 2>,
        raw: Tensor<Self, 2>,
        scale: f64,
        sp: &SplineParams,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        if !B::SPLINE_KERNEL {
            return crate::spline::coupling_spline(x, raw, scale, false, sp);
        }
        split_spline(Self::spline_joint(x, raw, scale, sp, None, None))
    }

    fn fused_sigmoid(x: Tensor<Self, 2>) -> Tensor<Self, 2> {
        Self::sigmoid_at(x, Precision::F32)
    }

    fn elu_at(x: Tensor<Self, 2>, precision: Precision) -> Tensor<Self, 2> {
        let (f, g) = (B::fused_elu, B::fused_elu_backward);
        // At Precision::Half the float16 output, for the next layer's float16 product.
        activation(Activation::Elu, x, f, g, (precision, false))
    }

    const LAYER_KERNELS: bool = B::LAYER_KERNELS;

    fn spline_joint(
        x: Tensor<Self, 2>,
        raw: Tensor<Self, 2>,
        scale: f64,
        sp: &SplineParams,
        state_start: Option<usize>,
        bias: Option<Tensor<Self, 1>>,
    ) -> Tensor<Self, 2> {
        if !B::SPLINE_KERNEL {
            let x = match state_start {
                Some(start) => transformed_columns(x, start),
                None => x,
            };
            let raw = with_row_bias(raw, bias);
            let (y, ld) = crate::spline::coupling_spline(x, raw, scale, false, sp);
            return Tensor::cat(vec![y, ld], 1);
        }
        if let Some(bias) = bias {
            let (x, r, b) = (prim(x), prim(raw), prim(bias));
            let xi = wrap::<B, 2>(x.primitive.clone());
            let ri = wrap::<B, 2>(r.primitive.clone());
            let bi = wrap::<B, 1>(b.primitive.clone());
            let both = B::spline_kernel_forward(
                xi.clone(),
                ri.clone(),
                scale,
                sp,
                state_start,
                Some(bi.clone()),
            );
            let output = prim(both);
            let tracked = match (SplineBiasBackward {
                scale,
                sp: *sp,
                state_start,
            })
            .prepare::<C>([x.node.clone(), r.node.clone(), b.node.clone()])
            .compute_bound()
            .stateful()
            {
                OpsKind::Tracked(prep) => prep.finish((xi, ri, bi), output),
                OpsKind::UnTracked(prep) => prep.finish(output),
            };
            return wrap(tracked);
        }
        let x = x.into_primitive().tensor();
        let r = raw.into_primitive().tensor();
        let xi = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(x.primitive.clone()));
        let ri = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(r.primitive.clone()));
        let both = B::spline_kernel_forward(xi.clone(), ri.clone(), scale, sp, state_start, None);
        let output = both.into_primitive().tensor();
        let tracked = match (SplineBackward {
            scale,
            sp: *sp,
            state_start,
        })
        .prepare::<C>([x.node.clone(), r.node.clone()])
        .compute_bound()
        .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((xi, ri), output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        };
        Tensor::from_primitive(TensorPrimitive::Float(tracked))
    }

    fn coupling_split(
        state: Tensor<Self, 2>,
        ctx: Tensor<Self, 2>,
        start: usize,
    ) -> Tensor<Self, 2> {
        if !B::LAYER_KERNELS || !all_f32(&[state.dtype(), ctx.dtype()]) {
            return coupling_split_composed(state, ctx, start);
        }
        let w = state.dims()[1];
        let (sp, cp) = (prim(state), prim(ctx));
        let out = B::coupling_split_kernel_forward(
            wrap(sp.primitive.clone()),
            wrap(cp.primitive.clone()),
            start,
        );
        let output = prim(out);
        let tracked = match (SplitBackward { w, start })
            .prepare::<C>([sp.node.clone(), cp.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((), output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        };
        wrap(tracked)
    }

    fn coupling_place(
        state: Tensor<Self, 2>,
        both: Tensor<Self, 2>,
        start: usize,
    ) -> Tensor<Self, 2> {
        if !B::LAYER_KERNELS || !all_f32(&[state.dtype(), both.dtype()]) {
            return coupling_place_composed(state, both, start);
        }
        let (sp, bp) = (prim(state), prim(both));
        let out = B::coupling_place_kernel_forward(
            wrap(sp.primitive.clone()),
            wrap(bp.primitive.clone()),
            start,
        );
        let output = prim(out);
        let tracked = match (PlaceBackward { start })
            .prepare::<C>([sp.node.clone(), bp.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((), output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        };
        wrap(tracked)
    }

    fn base_log_prob(state: Tensor<Self, 2>, c: f64, jac: f64) -> Tensor<Self, 1> {
        if !B::LAYER_KERNELS || !all_f32(&[state.dtype()]) {
            let (z, logdet) = state_parts(state);
            return base_log_prob_composed(z, logdet, c, jac);
        }
        let sp = prim(state);
        let si = wrap::<B, 2>(sp.primitive.clone());
        let out = B::base_log_prob_kernel_forward(si.clone(), c, jac);
        let output = prim(out);
        let tracked = match BaseLogProbBackward
            .prepare::<C>([sp.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(si, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        };
        wrap(tracked)
    }

    fn lu_affine(
        lower: Tensor<Self, 1>,
        upper: Tensor<Self, 1>,
        diag: Tensor<Self, 1>,
        bias: Tensor<Self, 1>,
        eps: f64,
        perm: Option<&[usize]>,
    ) -> Tensor<Self, 2> {
        let dtypes = [lower.dtype(), upper.dtype(), diag.dtype(), bias.dtype()];
        if !B::LAYER_KERNELS || !all_f32(&dtypes) {
            return lu_affine_composed(lower, upper, diag, bias, eps, perm);
        }
        let (l, u, d, b) = (prim(lower), prim(upper), prim(diag), prim(bias));
        let inner = |v: &burn::tensor::ops::FloatTensor<Self>| wrap::<B, 1>(v.primitive.clone());
        let perm = perm.map(|p| permutation_values::<B>(p, &inner(&d).device()));
        let state = (inner(&l), inner(&u), inner(&d), perm);
        let a = B::lu_affine_kernel_forward(
            state.0.clone(),
            state.1.clone(),
            state.2.clone(),
            inner(&b),
            state.3.clone(),
            eps,
        );
        let output = prim(a);
        let nodes = [&l, &u, &d, &b].map(|v| v.node.clone());
        let tracked = match (LuAffineBackward { eps })
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        };
        wrap(tracked)
    }

    fn fused_layer_norm(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        bias: Tensor<Self, 1>,
        eps: f64,
        elu: bool,
    ) -> Tensor<Self, 2> {
        let f32s = all_f32(&[x.dtype(), weight.dtype(), bias.dtype()]);
        if !B::LAYER_KERNELS || !f32s {
            return layer_norm_composed(x, weight, bias, eps, elu);
        }
        let (x, w, b) = (prim(x), prim(weight), prim(bias));
        let xi = wrap::<B, 2>(x.primitive.clone());
        let wi = wrap::<B, 1>(w.primitive.clone());
        let bi = wrap::<B, 1>(b.primitive.clone());
        let (y, stats) = B::layer_norm_kernel_forward(xi.clone(), wi.clone(), bi, eps, elu);
        let output = prim(y.clone());
        let tracked = match (LayerNormBackward { elu })
            .prepare::<C>([x.node.clone(), w.node.clone(), b.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((xi, wi, y, stats), output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        };
        wrap(tracked)
    }

    fn linear_product(x: Tensor<Self, 2>, weight: Tensor<Self, 1>) -> Tensor<Self, 2> {
        let (x, w) = (prim(x), prim(weight));
        let (xi, wi) = (
            wrap::<B, 2>(x.primitive.clone()),
            wrap::<B, 1>(w.primitive.clone()),
        );
        let output = prim(product(xi.clone(), wi.clone()));
        let tracked = match LinearProductBackward
            .prepare::<C>([x.node.clone(), w.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((xi, wi), output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        };
        wrap(tracked)
    }

    fn linear_residual(
        x: Tensor<Self, 2>,
        t: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        bias: Tensor<Self, 1>,
    ) -> Tensor<Self, 2> {
        let f32s = all_f32(&[x.dtype(), t.dtype(), weight.dtype(), bias.dtype()]);
        if !B::LAYER_KERNELS || !f32s {
            return x + Self::fused_linear(t, weight, bias);
        }
        let [x, t] = [prim(x), prim(t)];
        let [w, b] = [prim(weight), prim(bias)];
        let (ti, wi) = (
            wrap::<B, 2>(t.primitive.clone()),
            wrap::<B, 1>(w.primitive.clone()),
        );
        let y = B::residual_kernel_forward(
            wrap(x.primitive.clone()),
            product(ti.clone(), wi.clone()),
            wrap(b.primitive.clone()),
        );
        let output = prim(y);
        let nodes = [&x, &t, &w, &b].map(|v| v.node.clone());
        let tracked = match LinearResidualBackward
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((ti, wi), output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        };
        wrap(tracked)
    }

    fn linear_elu_at(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        weight_f16: Option<Tensor<Self, 1>>,
        bias: Tensor<Self, 1>,
        precision: Precision,
    ) -> Tensor<Self, 2> {
        use burn::tensor::DType;
        let fits = match precision {
            Precision::F32 => all_f32(&[x.dtype(), weight.dtype(), bias.dtype()]),
            Precision::Half => {
                all_f32(&[weight.dtype(), bias.dtype()])
                    && matches!(x.dtype(), DType::F32 | DType::F16)
            }
        };
        if !B::LAYER_KERNELS || !fits {
            let y = Self::linear_at(x, weight, weight_f16, bias, precision);
            return Self::elu_at(y, precision);
        }
        let (x, w, b) = (prim(x), prim(weight), prim(bias));
        let xi = wrap::<B, 2>(x.primitive.clone());
        let wi = wrap::<B, 1>(w.primitive.clone());
        let bi = wrap::<B, 1>(b.primitive.clone());
        // At Precision::Half the state keeps the float16 operands and the float16 output.
        let (xi, wi) = match precision {
            Precision::F32 => (xi, wi),
            Precision::Half => (
                xi.cast(FloatDType::F16),
                weight_f16.map_or(wi, |w| w.inner()).cast(FloatDType::F16),
            ),
        };
        let y = B::linear_elu_at(xi.clone(), wi.clone(), None, bi, precision);
        let output = prim(y.clone());
        let tracked = match (LinearEluBackward { precision })
            .prepare::<C>([x.node.clone(), w.node.clone(), b.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish((xi, wi, y), output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        };
        wrap(tracked)
    }

    fn gated_residual(
        x: Tensor<Self, 2>,
        t: Tensor<Self, 2>,
        w1: Tensor<Self, 1>,
        w1_f16: Option<Tensor<Self, 1>>,
        b1: Tensor<Self, 1>,
        context: Tensor<Self, 2>,
        wc: Tensor<Self, 1>,
        bc: Tensor<Self, 1>,
        precision: Precision,
    ) -> Tensor<Self, 2> {
        let others = [x.dtype(), w1.dtype(), b1.dtype(), context.dtype()];
        let context_layer = [wc.dtype(), bc.dtype()];
        if !B::LAYER_KERNELS || !gated_kernel_takes(t.dtype(), &others, context_layer, precision) {
            let w1 = (w1, w1_f16);
            return gated_composed(x, t, w1, b1, context, wc, bc, precision);
        }
        let w1_f16 = w1_f16.map(|w| w.inner());
        let [x, t, context] = [prim(x), prim(t), prim(context)];
        let [w1, b1, wc, bc] = [prim(w1), prim(b1), prim(wc), prim(bc)];
        type Prim<B, C> = burn::tensor::ops::FloatTensor<Autodiff<B, C>>;
        let inner2 = |v: &Prim<B, C>| wrap::<B, 2>(v.primitive.clone());
        let inner1 = |v: &Prim<B, C>| wrap::<B, 1>(v.primitive.clone());
        // At Precision::Half the state keeps the float16 operands (as autocast saves them).
        let (a, ts, w1s) = gated_product(inner2(&t), inner1(&w1), w1_f16, precision);
        let (y, s) = B::gated_kernel_forward(
            inner2(&x),
            a.clone(),
            inner1(&b1),
            inner2(&context),
            inner1(&wc),
            inner1(&bc),
        );
        let state = GatedState {
            t: ts,
            w1: w1s,
            b1: inner1(&b1),
            context: inner2(&context),
            wc: inner1(&wc),
            a,
            s,
        };
        let output = prim(y);
        let nodes = [&x, &t, &w1, &b1, &context, &wc, &bc].map(|v| v.node.clone());
        let tracked = match (GatedBackward { precision })
            .prepare::<C>(nodes)
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => prep.finish(state, output),
            OpsKind::UnTracked(prep) => prep.finish(output),
        };
        wrap(tracked)
    }

    fn sigmoid_at(x: Tensor<Self, 2>, precision: Precision) -> Tensor<Self, 2> {
        let (f, g) = (B::fused_sigmoid, B::fused_sigmoid_backward);
        // The gate multiplies float32 values: its output stays float32.
        activation(Activation::Sigmoid, x, f, g, (precision, true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

    type Ad = Autodiff<NdArray<f32>>;

    #[test]
    fn exp_f32_is_within_a_few_ulp_of_exp_over_the_range() {
        let mut worst = 0.0f64;
        let n = 2_000_000;
        for i in 0..=n {
            let x = -87.0 + 175.0 * i as f64 / n as f64;
            let got = exp_f32(x as f32) as f64;
            let want = (x as f32 as f64).exp();
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 3e-7, "worst relative error {worst:e}");
        assert_eq!(exp_f32(0.0), 1.0);
        assert!(exp_f32(f32::NAN).is_nan());
        assert!(exp_f32(-1e4) > 0.0 && exp_f32(-1e4) < 2e-38);
        assert!(exp_f32(1e4).is_finite() && exp_f32(1e4) > 1e38);
    }

    fn values(n: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (i as f32 * 0.7371).sin() * 9.0 - (i % 7) as f32 * 0.01)
            .collect()
    }

    fn tensor<B: Backend>(v: &[f32], device: &B::Device) -> Tensor<B, 2> {
        Tensor::from_data(TensorData::new(v.to_vec(), [v.len() / 8, 8]), device)
    }

    fn vec<B: Backend>(t: Tensor<B, 2>) -> Vec<f64> {
        t.into_data().convert::<f64>().to_vec::<f64>().unwrap()
    }

    /// The fused f32 kernels against the formulas in f64, and the autodiff gradients against
    /// the analytic derivatives.
    #[test]
    fn fused_activations_and_their_gradients_match_the_formulas() {
        let device = Default::default();
        let v = values(8 * 129);
        let elu = |x: f64| if x > 0.0 { x } else { x.exp() - 1.0 };
        let sig = |x: f64| 1.0 / (1.0 + (-x).exp());
        let delu = |x: f64| if x > 0.0 { 1.0 } else { x.exp() };
        let dsig = |x: f64| {
            let s = 1.0 / (1.0 + (-x).exp());
            s * (1.0 - s)
        };
        type Fwd = fn(Tensor<Ad, 2>) -> Tensor<Ad, 2>;
        type Scalar = fn(f64) -> f64;
        let cases: [(Fwd, Scalar, Scalar); 2] = [
            (<Ad as FusedOps>::fused_elu, elu, delu),
            (<Ad as FusedOps>::fused_sigmoid, sig, dsig),
        ];
        for (f, value, slope) in cases {
            let x = tensor::<Ad>(&v, &device).require_grad();
            let w = tensor::<Ad>(
                &values(8 * 129)[..]
                    .iter()
                    .map(|a| a * 0.1 + 1.0)
                    .collect::<Vec<_>>(),
                &device,
            );
            let y = f(x.clone());
            let grads = (y.clone() * w.clone()).sum().backward();
            let dx = vec(x.grad(&grads).unwrap());
            for (i, (&xi, (yi, dxi))) in v.iter().zip(vec(y).into_iter().zip(dx)).enumerate() {
                let x = xi as f64;
                let wi = v[i] as f64 * 0.1 + 1.0;
                assert!(
                    (yi - value(x)).abs() <= 1e-6 * value(x).abs().max(1.0),
                    "value at {x}: {yi}"
                );
                let want = slope(x) * (wi as f32 as f64);
                // The slope comes from the f32 output (`y + 1`, `s (1 - s)`): its error is
                // about an ulp of 1, not of the slope.
                assert!(
                    (dxi - want).abs() <= 2e-6 * want.abs() + 2e-7 * wi.abs(),
                    "slope at {x}: {dxi} vs {want}"
                );
            }
        }
    }

    /// The fused linear layer against burn's composed one, values and the gradients of all
    /// three inputs; a constant weight gets no gradient; a transposed input gives the same.
    #[test]
    fn fused_linear_and_its_gradients_match_the_composed_layer() {
        let device = Default::default();
        let (m, k, n) = (37, 19, 11);
        let xv: Vec<f32> = values(m * k);
        let wv: Vec<f32> = values(n * k + 5)[5..].iter().map(|a| a * 0.3).collect();
        let bv: Vec<f32> = values(n + 3)[3..].to_vec();
        let gv: Vec<f32> = values(m * n + 7)[7..].iter().map(|a| a * 0.1).collect();
        let make = |transposed: bool| {
            let x = if transposed {
                // The same [m, k] matrix, stored as its transpose.
                let xt: Vec<f32> = (0..k * m).map(|i| xv[(i % m) * k + i / m]).collect();
                Tensor::<Ad, 2>::from_data(TensorData::new(xt, [k, m]), &device).transpose()
            } else {
                Tensor::<Ad, 2>::from_data(TensorData::new(xv.clone(), [m, k]), &device)
            };
            let w = Tensor::<Ad, 1>::from_data(TensorData::new(wv.clone(), [n * k]), &device);
            let b = Tensor::<Ad, 1>::from_data(TensorData::new(bv.clone(), [n]), &device);
            (x.require_grad(), w.require_grad(), b.require_grad())
        };
        let g = Tensor::<Ad, 2>::from_data(TensorData::new(gv.clone(), [m, n]), &device);
        let close = |a: Vec<f64>, b: Vec<f64>| {
            assert_eq!(a.len(), b.len());
            let scale = b.iter().fold(0.0f64, |s, v| s.max(v.abs()));
            for (a, b) in a.iter().zip(&b) {
                assert!((a - b).abs() <= 1e-5 * scale, "{a} vs {b}");
            }
        };
        let (x0, w0, b0) = make(false);
        let y0 = linear_composed(x0.clone(), w0.clone(), b0.clone());
        let grads0 = (y0.clone() * g.clone()).sum().backward();
        for transposed in [false, true] {
            let (x, w, b) = make(transposed);
            let y = Ad::fused_linear(x.clone(), w.clone(), b.clone());
            close(vec(y.clone()), vec(y0.clone()));
            let grads = (y * g.clone()).sum().backward();
            close(vec(x.grad(&grads).unwrap()), vec(x0.grad(&grads0).unwrap()));
            let w_grad = |w: &Tensor<Ad, 1>, gr| vec(w.grad(gr).unwrap().unsqueeze::<2>());
            close(w_grad(&w, &grads), w_grad(&w0, &grads0));
            close(w_grad(&b, &grads), w_grad(&b0, &grads0));
        }
        // A constant (frozen) weight: gradients for x and b only.
        let (x, _, b) = make(false);
        let w = Tensor::<Ad, 1>::from_data(TensorData::new(wv.clone(), [n * k]), &device);
        let grads = (Ad::fused_linear(x.clone(), w.clone(), b.clone()) * g)
            .sum()
            .backward();
        assert!(w.grad(&grads).is_none());
        close(vec(x.grad(&grads).unwrap()), vec(x0.grad(&grads0).unwrap()));
    }

    /// The fused kernels and the composed formulas (what CUDA and f64 run) agree.
    #[test]
    fn fused_kernels_match_the_composed_formulas() {
        let device = Default::default();
        let v = values(8 * 77);
        let x = || tensor::<NdArray<f32>>(&v, &device);
        let close = |a: Vec<f64>, b: Vec<f64>| {
            a.iter()
                .zip(&b)
                .all(|(a, b)| (a - b).abs() <= 1e-6 * a.abs().max(1.0))
        };
        assert!(close(
            vec(NdArray::<f32>::fused_elu(x())),
            vec(elu_composed(x()))
        ));
        assert!(close(
            vec(NdArray::<f32>::fused_sigmoid(x())),
            vec(sigmoid_composed(x()))
        ));
        let y = NdArray::<f32>::fused_elu(x());
        assert!(close(
            vec(NdArray::<f32>::fused_elu_backward(y.clone(), x())),
            vec(elu_backward_composed(y, x()))
        ));
        let s = NdArray::<f32>::fused_sigmoid(x());
        assert!(close(
            vec(NdArray::<f32>::fused_sigmoid_backward(s.clone(), x())),
            vec(sigmoid_backward_composed(s, x()))
        ));
        // A transposed (non-contiguous) input takes the copy path and gives the same values.
        let t = x().transpose();
        assert!(close(
            vec(NdArray::<f32>::fused_elu(t.clone())),
            vec(elu_composed(t))
        ));
    }
}
