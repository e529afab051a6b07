//! The optimizer on the device (lockstep-train's [`lockstep_train::device_state`]): CubeCL
//! kernels for burn's wgpu and CUDA backends over the packed float32 buffers the model keeps
//! there ([`crate::resident`]): parameters, gradient, optimizer slots.
//!
//! - [`pack_many_launch`]: the parameters' gradients into their places in the packed
//!   gradient (a copy, or an addition for the later micro-batches of gradient accumulation),
//!   up to [`pack_group`] gradients per launch (a pass's ~160 gradients in about ten
//!   launches);
//! - [`non_finite_launch`]: a flag (`[1]`, float32) set to 1 when any value of the packed
//!   gradient is an infinity or NaN (the loss scaler's test; every thread that finds one
//!   writes the same 1, so the result does not depend on the order);
//! - [`update_launch`] (Adam or SGD): one update over the whole packed buffer, one thread per
//!   value, with every scalar (learning rate, bias corrections, the gradient's factors) a
//!   kernel argument computed on the host ([`DeviceUpdate`]): the host optimizer's
//!   operations in its order (`crates/lockstep-train/src/optim.rs`), float32, so a device
//!   that rounds each operation as the CPU does (lavapipe: no contraction into fused
//!   multiply-adds, a correctly rounded square root and division) gives the same bits.
//!
//! The destination buffers are written in place: they are the model's own state, which no
//! other tensor aliases while the kernels run (the pass's parameter views read them before,
//! in queue order).

use burn::tensor::DType;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::*;
use cubecl::{calculate_cube_count_elemwise, CubeDim};
use lockstep_train::{DeviceRule, DeviceUpdate};

/// Many gradients into their places in `dst`: thread `i < n` is position `p = base + i` of
/// `dst`, which source `j` covers when `starts[j] <= p < starts[j] + lens[j]`;
/// `dst[p] = srcs[j][p - starts[j]]` (`add == 0`) or `dst[p] + srcs[j][p - starts[j]]`
/// (`add == 1`). Positions no source covers (the alignment gaps) are left as they are. The
/// sources are a comptime-length sequence (one compiled kernel per group size).
#[cube(launch)]
fn pack_many(
    srcs: &Sequence<Array<f32>>,
    starts: &Sequence<u32>,
    lens: &Sequence<u32>,
    dst: &mut Array<f32>,
    base: u32,
    n: u32,
    add: u32,
) {
    let i = ABSOLUTE_POS as u32;
    if i >= n {
        terminate!();
    }
    let p = base + i;
    let k = srcs.len().comptime();
    #[unroll]
    for j in 0..k {
        let s = starts[j];
        if p >= s && p < s + lens[j] {
            let v = srcs[j][(p - s) as usize];
            if add == 1 {
                dst[p as usize] = dst[p as usize] + v;
            } else {
                dst[p as usize] = v;
            }
        }
    }
}

/// `dst[i] = 0`, `i < n`.
#[cube(launch)]
fn fill_zero(dst: &mut Array<f32>, n: u32) {
    let i = ABSOLUTE_POS as u32;
    if i >= n {
        terminate!();
    }
    dst[i as usize] = 0.0;
}

/// `flag[0] = 1` when some `g[i]`, `i < n`, is an infinity or NaN (`flag` starts at 0).
#[cube(launch)]
fn non_finite(g: &Array<f32>, flag: &mut Array<f32>, n: u32) {
    let i = ABSOLUTE_POS as u32;
    if i >= n {
        terminate!();
    }
    let x = g[i as usize];
    if x.is_nan() || x.is_inf() {
        flag[0] = 1.0;
    }
}

/// Adam / AdamW on `i < n` (see [`DeviceRule::Adam`]); `s = [lr, grad_factor, unscale,
/// beta1, 1 - beta1, beta2, 1 - beta2, epsilon, keep, c1, c2]`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn adam(
    p: &mut Array<f32>,
    m: &mut Array<f32>,
    v: &mut Array<f32>,
    g: &Array<f32>,
    n: u32,
    lr: f32,
    grad_factor: f32,
    unscale: f32,
    beta1: f32,
    one_minus_beta1: f32,
    beta2: f32,
    one_minus_beta2: f32,
    epsilon: f32,
    keep: f32,
    c1: f32,
    c2: f32,
) {
    let i = ABSOLUTE_POS as u32;
    if i >= n {
        terminate!();
    }
    let k = i as usize;
    let gi = g[k] * grad_factor * unscale;
    let pk = p[k] * keep;
    let mk = beta1 * m[k] + one_minus_beta1 * gi;
    let vk = beta2 * v[k] + one_minus_beta2 * gi * gi;
    m[k] = mk;
    v[k] = vk;
    let m_hat = mk / c1;
    let v_hat = vk / c2;
    p[k] = pk - lr * m_hat / (f32::sqrt(v_hat) + epsilon);
}

/// SGD with momentum on `i < n` (see [`DeviceRule::Sgd`]).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn sgd(
    p: &mut Array<f32>,
    vel: &mut Array<f32>,
    g: &Array<f32>,
    n: u32,
    lr: f32,
    grad_factor: f32,
    unscale: f32,
    momentum: f32,
) {
    let i = ABSOLUTE_POS as u32;
    if i >= n {
        terminate!();
    }
    let k = i as usize;
    let gi = g[k] * grad_factor * unscale;
    let vk = momentum * vel[k] + gi;
    vel[k] = vk;
    p[k] = p[k] - lr * vk;
}

/// The launch grid for `threads` threads on `t`'s device.
fn grid<R: CubeRuntime>(t: &CubeTensor<R>, threads: usize) -> (CubeCount, CubeDim) {
    let client = &t.client;
    let dim = CubeDim::new(client, threads.max(1));
    (
        calculate_cube_count_elemwise(client, threads.max(1), dim),
        dim,
    )
}

/// The number of values of the float32 vector `t`, as the kernels' `u32`.
///
/// Panics on another dtype, a tensor that is not contiguous, or 2^32 values or more.
fn len<R: CubeRuntime>(t: &CubeTensor<R>, what: &str) -> u32 {
    assert_eq!(
        t.dtype,
        DType::F32,
        "optimizer kernel: {what} is not float32"
    );
    assert!(
        t.is_contiguous(),
        "optimizer kernel: {what} is not contiguous"
    );
    u32::try_from(t.meta.shape().num_elements()).expect("optimizer kernel: fewer than 2^32 values")
}

/// The most gradients [`pack_many_launch`] binds in one launch on `client`'s device: 16, or
/// fewer where the adapter allows fewer storage buffers per shader stage (the destination
/// and CubeCL's metadata buffer take two; WebGPU's default limit of 8 gives 5).
pub fn pack_group<R: CubeRuntime>(client: &ComputeClient<R>) -> usize {
    let bindings = client.properties().hardware.max_bindings as usize;
    bindings.saturating_sub(2).clamp(1, 16)
}

/// Writes each `(gradient, offset)` of `srcs` into `dst` at `offset` (a copy, or an
/// addition when `add`): [`pack_group`] gradients per launch, `ceil(len / group)` launches
/// (plus one copy for a gradient that is not contiguous). `dst` is the whole packed
/// gradient (float32); the offsets are in values, the ranges disjoint.
///
/// Panics on a dtype other than float32, a range outside `dst`, or 2^32 values or more.
pub fn pack_many_launch<R: CubeRuntime>(
    srcs: Vec<(CubeTensor<R>, usize)>,
    dst: &CubeTensor<R>,
    add: bool,
) {
    let total = len(dst, "the packed gradient");
    let group = pack_group(&dst.client);
    let mut srcs: Vec<(CubeTensor<R>, u32, u32)> = srcs
        .into_iter()
        .map(|(src, offset)| {
            let src = burn_cubecl::kernel::into_contiguous(src);
            let n = len(&src, "a gradient");
            let start = u32::try_from(offset).expect("optimizer kernel: offset below 2^32");
            assert!(
                start as u64 + n as u64 <= total as u64,
                "optimizer kernel: a gradient of {n} values at {start} outside {total}"
            );
            (src, start, n)
        })
        .collect();
    srcs.sort_by_key(|s| s.1);
    for chunk in srcs.chunks(group) {
        let base = chunk[0].1;
        let end = chunk.iter().map(|c| c.1 + c.2).max().unwrap_or(base);
        let threads = (end - base) as usize;
        if threads == 0 {
            continue;
        }
        let (count, dim) = grid(dst, threads);
        let mut arrays = SequenceArg::<R, Array<f32>>::new();
        let mut starts = SequenceArg::<R, u32>::new();
        let mut lens = SequenceArg::<R, u32>::new();
        for (src, start, n) in chunk {
            arrays.push(src.clone().into_array_arg());
            starts.push(*start);
            lens.push(*n);
        }
        pack_many::launch::<R>(
            &dst.client.clone(),
            count,
            dim,
            arrays,
            starts,
            lens,
            dst.clone().into_array_arg(),
            base,
            end - base,
            u32::from(add),
        );
    }
}

/// Sets every value of `dst` to 0. One launch.
pub fn zero_launch<R: CubeRuntime>(dst: &CubeTensor<R>) {
    let n = len(dst, "the packed gradient");
    let (count, dim) = grid(dst, n as usize);
    fill_zero::launch::<R>(
        &dst.client.clone(),
        count,
        dim,
        dst.clone().into_array_arg(),
        n,
    );
}

/// Into `flag` (`[1]`, float32, 0 before): 1 when some value of `g` is not finite. One
/// launch.
pub fn non_finite_launch<R: CubeRuntime>(g: &CubeTensor<R>, flag: &CubeTensor<R>) {
    let n = len(g, "the packed gradient");
    assert_eq!(len(flag, "the flag"), 1, "optimizer kernel: the flag");
    let (count, dim) = grid(g, n as usize);
    non_finite::launch::<R>(
        &g.client.clone(),
        count,
        dim,
        g.clone().into_array_arg(),
        flag.clone().into_array_arg(),
        n,
    );
}

/// One optimizer update of the packed parameters `p` with the optimizer `slots` (Adam
/// `[m, v]`, SGD `[velocity]`) and the gradient `g`, all of one length, in place. One
/// launch.
///
/// Panics on lengths that differ, the wrong number of slots, or another dtype.
pub fn update_launch<R: CubeRuntime>(
    p: &CubeTensor<R>,
    slots: &[CubeTensor<R>],
    g: &CubeTensor<R>,
    u: &DeviceUpdate,
) {
    let n = len(p, "the parameters");
    assert_eq!(len(g, "the gradient"), n, "optimizer kernel: lengths");
    for s in slots {
        assert_eq!(len(s, "a slot"), n, "optimizer kernel: lengths");
    }
    let (count, dim) = grid(p, n as usize);
    let client = p.client.clone();
    match u.rule {
        DeviceRule::Adam {
            beta1,
            one_minus_beta1,
            beta2,
            one_minus_beta2,
            epsilon,
            keep,
            c1,
            c2,
        } => {
            assert_eq!(slots.len(), 2, "optimizer kernel: Adam has two slots");
            adam::launch::<R>(
                &client,
                count,
                dim,
                p.clone().into_array_arg(),
                slots[0].clone().into_array_arg(),
                slots[1].clone().into_array_arg(),
                g.clone().into_array_arg(),
                n,
                u.learning_rate,
                u.grad_factor,
                u.unscale,
                beta1,
                one_minus_beta1,
                beta2,
                one_minus_beta2,
                epsilon,
                keep,
                c1,
                c2,
            );
        }
        DeviceRule::Sgd { momentum } => {
            assert_eq!(slots.len(), 1, "optimizer kernel: SGD has one slot");
            sgd::launch::<R>(
                &client,
                count,
                dim,
                p.clone().into_array_arg(),
                slots[0].clone().into_array_arg(),
                g.clone().into_array_arg(),
                n,
                u.learning_rate,
                u.grad_factor,
                u.unscale,
                momentum,
            );
        }
    }
}
