//! burn's `fusion` over the GPU backend with lockstep's kernels (feature `fusion`): the
//! backend [`WgpuFusion`] = `Fusion<CubeBackend<WgpuRuntime>>`, on which burn records the
//! tensor operations lazily and merges runs of elementwise operations and reductions into
//! fewer kernels, and [`FusedOps`] for it.
//!
//! Each of lockstep's own kernels (the operations [`FusedOps`] overrides on the CubeCL
//! backend: the spline, LayerNorm, the gated tail, the LU map, the coupling's ends, the
//! base density, the optimizer's kernels) runs on the inner backend: the fusion stream up
//! to its inputs is executed first (its fused kernels launched, nothing read back), the
//! kernel is launched, and its outputs enter the stream as initialized tensors. So the
//! kernels are barriers to fusion, as a registered custom operation would be, and burn can
//! merge only what lies between them: its own elementwise operations and reductions (58
//! binary operations and 23 reductions of the 393 float32 launches of the Dingo-shaped
//! step). The operations of those methods that are burn's own (the products and casts
//! inside `linear_elu_at`, `linear_at`, `gated_residual` in mixed precision) run there too.
//!
//! This exists to measure fusion on the fused step (issue 58: `bench npe --device gpu` with
//! `LOCKSTEP_NPE_FUSION=1` in a build with `--features lockstep-cli/fusion`); the default
//! build does not compile it, and `local.device: gpu` never uses it.

use crate::activation_kernel::Activation;
use crate::fused_ops::{FusedOps, GatedGradients, LinearGradients, Precision};
use crate::spline::SplineParams;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_fusion::stream::OperationStreams;
use burn_fusion::{get_client, Fusion, FusionBackend, NoOp};
use burn_ir::{InitOperationIr, OperationIr, OperationOutput};

/// burn's wgpu backend (float32) under burn's fusion.
pub type WgpuFusion = Fusion<burn::backend::Wgpu>;

/// [`WgpuFusion`] with autodiff: the backend the NPE trains on with fusion.
pub type WgpuFusionAutodiff = burn::backend::Autodiff<WgpuFusion>;

/// The values of a fusion tensor on the inner backend: the stream up to it is executed
/// (kernels launched; no read-back).
fn inner<B: FusionBackend, const D: usize>(t: Tensor<Fusion<B>, D>) -> Tensor<B, D> {
    let p = t.into_primitive().tensor();
    let client = p.client.clone();
    Tensor::from_primitive(TensorPrimitive::Float(client.resolve_tensor_float::<B>(p)))
}

/// An inner-backend tensor as an initialized tensor of the fusion stream.
fn outer<B: FusionBackend, const D: usize>(t: Tensor<B, D>) -> Tensor<Fusion<B>, D> {
    let (device, shape, dtype) = (t.device(), t.shape(), t.dtype());
    let client = get_client::<B>(&device);
    let handle = B::float_tensor_handle(t.into_primitive().tensor());
    let desc = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
    let out = client
        .register(
            OperationStreams::default(),
            OperationIr::Init(desc),
            NoOp::<B>::new(),
        )
        .output();
    Tensor::from_primitive(TensorPrimitive::Float(out))
}

fn inner_opt<B: FusionBackend, const D: usize>(
    t: Option<Tensor<Fusion<B>, D>>,
) -> Option<Tensor<B, D>> {
    t.map(inner)
}

fn outer_opt<B: FusionBackend, const D: usize>(
    t: Option<Tensor<B, D>>,
) -> Option<Tensor<Fusion<B>, D>> {
    t.map(outer)
}

impl<B> FusedOps for Fusion<B>
where
    B: FusionBackend + FusedOps,
{
    const SPLINE_KERNEL: bool = B::SPLINE_KERNEL;
    const LAYER_KERNELS: bool = B::LAYER_KERNELS;

    fn upload_vectors(values: &[&[f32]], device: &Self::Device) -> Vec<Tensor<Self, 1>> {
        B::upload_vectors(values, device)
            .into_iter()
            .map(outer)
            .collect()
    }

    fn fused_elu(x: Tensor<Self, 2>) -> Tensor<Self, 2> {
        outer(B::fused_elu(inner(x)))
    }

    fn fused_elu_backward(y: Tensor<Self, 2>, grad: Tensor<Self, 2>) -> Tensor<Self, 2> {
        outer(B::fused_elu_backward(inner(y), inner(grad)))
    }

    fn fused_sigmoid(x: Tensor<Self, 2>) -> Tensor<Self, 2> {
        outer(B::fused_sigmoid(inner(x)))
    }

    fn fused_sigmoid_backward(s: Tensor<Self, 2>, grad: Tensor<Self, 2>) -> Tensor<Self, 2> {
        outer(B::fused_sigmoid_backward(inner(s), inner(grad)))
    }

    fn spline(
        x: Tensor<Self, 2>,
        raw: Tensor<Self, 2>,
        scale: f64,
        sp: &SplineParams,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        let (y, ld) = B::spline(inner(x), inner(raw), scale, sp);
        (outer(y), outer(ld))
    }

    fn spline_kernel_forward(
        x: Tensor<Self, 2>,
        raw: Tensor<Self, 2>,
        scale: f64,
        sp: &SplineParams,
        state_start: Option<usize>,
        bias: Option<Tensor<Self, 1>>,
    ) -> Tensor<Self, 2> {
        outer(B::spline_kernel_forward(
            inner(x),
            inner(raw),
            scale,
            sp,
            state_start,
            inner_opt(bias),
        ))
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
        let (dx, draw) = B::spline_kernel_backward(
            inner(x),
            inner(raw),
            inner(grad),
            scale,
            sp,
            state_start,
            inner_opt(bias),
        );
        (outer(dx), outer(draw))
    }

    fn activation_half(
        activation: Activation,
        x: Tensor<Self, 2>,
        wide: bool,
    ) -> Option<(Option<Tensor<Self, 2>>, Tensor<Self, 2>)> {
        B::activation_half(activation, inner(x), wide).map(|(y, yh)| (outer_opt(y), outer(yh)))
    }

    fn activation_half_backward(
        activation: Activation,
        yh: Tensor<Self, 2>,
        grad: Tensor<Self, 2>,
        narrow: bool,
    ) -> Option<Tensor<Self, 2>> {
        B::activation_half_backward(activation, inner(yh), inner(grad), narrow).map(outer)
    }

    fn device_optimizer() -> bool {
        B::device_optimizer()
    }

    fn view(buffer: &Tensor<Self, 1>, offset: usize, len: usize) -> Tensor<Self, 1> {
        outer(B::view(&inner(buffer.clone()), offset, len))
    }

    fn pack_many_into(srcs: Vec<(Tensor<Self, 1>, usize)>, dst: &Tensor<Self, 1>, add: bool) {
        let srcs = srcs.into_iter().map(|(t, o)| (inner(t), o)).collect();
        B::pack_many_into(srcs, &inner(dst.clone()), add)
    }

    fn zero_into(dst: &Tensor<Self, 1>) {
        B::zero_into(&inner(dst.clone()))
    }

    fn non_finite_flag(g: &Tensor<Self, 1>) -> Tensor<Self, 1> {
        outer(B::non_finite_flag(&inner(g.clone())))
    }

    fn optimizer_update(
        params: &Tensor<Self, 1>,
        slots: &[Tensor<Self, 1>],
        grad: &Tensor<Self, 1>,
        update: &lockstep_train::DeviceUpdate,
    ) {
        let slots: Vec<_> = slots.iter().map(|t| inner(t.clone())).collect();
        B::optimizer_update(&inner(params.clone()), &slots, &inner(grad.clone()), update)
    }

    fn fused_layer_norm(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        bias: Tensor<Self, 1>,
        eps: f64,
        elu: bool,
    ) -> Tensor<Self, 2> {
        outer(B::fused_layer_norm(
            inner(x),
            inner(weight),
            inner(bias),
            eps,
            elu,
        ))
    }

    fn layer_norm_kernel_forward(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        bias: Tensor<Self, 1>,
        eps: f64,
        elu: bool,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        let (y, stats) =
            B::layer_norm_kernel_forward(inner(x), inner(weight), inner(bias), eps, elu);
        (outer(y), outer(stats))
    }

    fn layer_norm_kernel_backward(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        y: Tensor<Self, 2>,
        stats: Tensor<Self, 2>,
        grad: Tensor<Self, 2>,
        elu: bool,
    ) -> (Tensor<Self, 2>, Tensor<Self, 1>, Tensor<Self, 1>) {
        let (dx, dw, db) = B::layer_norm_kernel_backward(
            inner(x),
            inner(weight),
            inner(y),
            inner(stats),
            inner(grad),
            elu,
        );
        (outer(dx), outer(dw), outer(db))
    }

    fn linear_elu_at(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        weight_f16: Option<Tensor<Self, 1>>,
        bias: Tensor<Self, 1>,
        precision: Precision,
    ) -> Tensor<Self, 2> {
        outer(B::linear_elu_at(
            inner(x),
            inner(weight),
            inner_opt(weight_f16),
            inner(bias),
            precision,
        ))
    }

    fn linear_residual(
        x: Tensor<Self, 2>,
        t: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        bias: Tensor<Self, 1>,
    ) -> Tensor<Self, 2> {
        outer(B::linear_residual(
            inner(x),
            inner(t),
            inner(weight),
            inner(bias),
        ))
    }

    fn residual_kernel_forward(
        x: Tensor<Self, 2>,
        a: Tensor<Self, 2>,
        bias: Tensor<Self, 1>,
    ) -> Tensor<Self, 2> {
        outer(B::residual_kernel_forward(inner(x), inner(a), inner(bias)))
    }

    fn bias_kernel_forward(
        a: Tensor<Self, 2>,
        bias: Tensor<Self, 1>,
        elu: bool,
    ) -> Tensor<Self, 2> {
        outer(B::bias_kernel_forward(inner(a), inner(bias), elu))
    }

    fn bias_kernel_backward(
        y: Tensor<Self, 2>,
        grad: Tensor<Self, 2>,
        elu: bool,
    ) -> (Tensor<Self, 2>, Tensor<Self, 1>) {
        let (da, db) = B::bias_kernel_backward(inner(y), inner(grad), elu);
        (outer(da), outer(db))
    }

    fn linear_at(
        x: Tensor<Self, 2>,
        weight: Tensor<Self, 1>,
        weight_f16: Option<Tensor<Self, 1>>,
        bias: Tensor<Self, 1>,
        precision: Precision,
    ) -> Tensor<Self, 2> {
        match precision {
            // The composed linear layer (burn's product and bias), as on the CubeCL backend.
            Precision::F32 => Self::fused_linear(x, weight, bias),
            Precision::Half => outer(B::linear_at(
                inner(x),
                inner(weight),
                inner_opt(weight_f16),
                inner(bias),
                precision,
            )),
        }
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
            Precision::Half => {
                let (dx, dw, db) =
                    B::linear_backward_at(inner(x), inner(weight), inner(grad), need, precision);
                (outer_opt(dx), outer_opt(dw), outer_opt(db))
            }
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
        outer(B::gated_residual(
            inner(x),
            inner(t),
            inner(w1),
            inner_opt(w1_f16),
            inner(b1),
            inner(context),
            inner(wc),
            inner(bc),
            precision,
        ))
    }

    fn gated_kernel_forward(
        x: Tensor<Self, 2>,
        a: Tensor<Self, 2>,
        b1: Tensor<Self, 1>,
        context: Tensor<Self, 2>,
        wc: Tensor<Self, 1>,
        bc: Tensor<Self, 1>,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        let (y, s) = B::gated_kernel_forward(
            inner(x),
            inner(a),
            inner(b1),
            inner(context),
            inner(wc),
            inner(bc),
        );
        (outer(y), outer(s))
    }

    fn gated_kernel_backward(
        a: Tensor<Self, 2>,
        b1: Tensor<Self, 1>,
        s: Tensor<Self, 2>,
        context: Tensor<Self, 2>,
        wc: Tensor<Self, 1>,
        grad: Tensor<Self, 2>,
    ) -> GatedGradients<Self> {
        let (da, dctx, dwc, db1, dbc) = B::gated_kernel_backward(
            inner(a),
            inner(b1),
            inner(s),
            inner(context),
            inner(wc),
            inner(grad),
        );
        (outer(da), outer(dctx), outer(dwc), outer(db1), outer(dbc))
    }

    fn lu_affine(
        lower: Tensor<Self, 1>,
        upper: Tensor<Self, 1>,
        diag: Tensor<Self, 1>,
        bias: Tensor<Self, 1>,
        eps: f64,
        perm: Option<&[usize]>,
    ) -> Tensor<Self, 2> {
        outer(B::lu_affine(
            inner(lower),
            inner(upper),
            inner(diag),
            inner(bias),
            eps,
            perm,
        ))
    }

    fn lu_affine_kernel_forward(
        lower: Tensor<Self, 1>,
        upper: Tensor<Self, 1>,
        diag: Tensor<Self, 1>,
        bias: Tensor<Self, 1>,
        perm: Option<Tensor<Self, 1>>,
        eps: f64,
    ) -> Tensor<Self, 2> {
        outer(B::lu_affine_kernel_forward(
            inner(lower),
            inner(upper),
            inner(diag),
            inner(bias),
            inner_opt(perm),
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
        B::lu_affine_kernel_backward(
            inner(lower),
            inner(upper),
            inner(diag),
            inner_opt(perm),
            inner(da),
            eps,
        )
        .map(outer)
    }

    fn coupling_split(
        state: Tensor<Self, 2>,
        ctx: Tensor<Self, 2>,
        start: usize,
    ) -> Tensor<Self, 2> {
        outer(B::coupling_split(inner(state), inner(ctx), start))
    }

    fn coupling_split_kernel_forward(
        state: Tensor<Self, 2>,
        ctx: Tensor<Self, 2>,
        start: usize,
    ) -> Tensor<Self, 2> {
        outer(B::coupling_split_kernel_forward(
            inner(state),
            inner(ctx),
            start,
        ))
    }

    fn coupling_split_kernel_backward(
        grad: Tensor<Self, 2>,
        w: usize,
        start: usize,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        let (ds, dc) = B::coupling_split_kernel_backward(inner(grad), w, start);
        (outer(ds), outer(dc))
    }

    fn coupling_place(
        state: Tensor<Self, 2>,
        both: Tensor<Self, 2>,
        start: usize,
    ) -> Tensor<Self, 2> {
        outer(B::coupling_place(inner(state), inner(both), start))
    }

    fn coupling_place_kernel_forward(
        state: Tensor<Self, 2>,
        both: Tensor<Self, 2>,
        start: usize,
    ) -> Tensor<Self, 2> {
        outer(B::coupling_place_kernel_forward(
            inner(state),
            inner(both),
            start,
        ))
    }

    fn coupling_place_kernel_backward(
        grad: Tensor<Self, 2>,
        start: usize,
    ) -> (Tensor<Self, 2>, Tensor<Self, 2>) {
        let (ds, db) = B::coupling_place_kernel_backward(inner(grad), start);
        (outer(ds), outer(db))
    }

    fn base_log_prob(state: Tensor<Self, 2>, c: f64, jac: f64) -> Tensor<Self, 1> {
        outer(B::base_log_prob(inner(state), c, jac))
    }

    fn base_log_prob_kernel_forward(state: Tensor<Self, 2>, c: f64, jac: f64) -> Tensor<Self, 1> {
        outer(B::base_log_prob_kernel_forward(inner(state), c, jac))
    }

    fn base_log_prob_kernel_backward(
        state: Tensor<Self, 2>,
        grad: Tensor<Self, 1>,
    ) -> Tensor<Self, 2> {
        outer(B::base_log_prob_kernel_backward(inner(state), inner(grad)))
    }
}

impl crate::sync_batch_norm::NormBackend for WgpuFusion {}
