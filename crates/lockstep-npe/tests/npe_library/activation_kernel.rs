//! ELU and the sigmoid as GPU kernels (`activation_kernel.rs`, one launch forward and one
//! backward each) against burn's autodiff of the composed forms in f64, on the machine's
//! Vulkan adapter (Mesa's lavapipe in CI; no adapter is a failure, never a skip): values
//! and gradients, for a batch of 1 and a batch whose element count is no multiple of a
//! workgroup, with arguments from -100 to 100 (exp's overflow and underflow, the kink at 0).

use burn::backend::{Autodiff, NdArray};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{FloatDType, Tensor, TensorData};
use lockstep_npe::device::{wgpu_device, WgpuAutodiff, WgpuBackend};
use lockstep_npe::fused_ops::{FusedOps, Precision};

/// `(act(x), dL/dx)` for `L = Σ a act(x)`, `x` and `a` `[rows, cols]`.
fn eval<B: AutodiffBackend + FusedOps>(
    device: &B::Device,
    dtype: FloatDType,
    sigmoid: bool,
    x: &[f32],
    a: &[f32],
    rows: usize,
) -> (Vec<f64>, Vec<f64>) {
    let cols = x.len() / rows;
    // burn keeps one default float dtype per device kind, so the dtype is set explicitly.
    let t = |v: &[f32]| {
        Tensor::<B, 2>::from_data(TensorData::new(v.to_vec(), [rows, cols]), device).cast(dtype)
    };
    let xt = t(x).require_grad();
    let y = if sigmoid {
        B::fused_sigmoid(xt.clone())
    } else {
        B::fused_elu(xt.clone())
    };
    let grads = (y.clone() * t(a)).sum().backward();
    let v = |d: TensorData| -> Vec<f64> { d.convert::<f64>().to_vec().unwrap() };
    (v(y.into_data()), v(xt.grad(&grads).unwrap().into_data()))
}

/// Deterministic values in [-1, 1).
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut rng = lockstep_core::rng::SplitMix64::new(seed);
    (0..n).map(|_| (2.0 * rng.uniform() - 1.0) as f32).collect()
}

#[test]
fn gpu_activation_kernels_match_the_composed_forms_and_their_gradients() {
    crate::common::cpu_default_f32();
    let device = wgpu_device(0).expect("a Vulkan adapter (lavapipe)");
    // 1 x 7 (a batch of one) and 37 x 13 = 481 values (no multiple of a workgroup).
    for (rows, cols) in [(1, 7), (37, 13)] {
        let n = rows * cols;
        let mut x: Vec<f32> = noise(n, 1).iter().map(|v| v * 6.0).collect();
        let edges = [-100.0, 100.0, 0.0, -0.0, 1e-7, -1e-7, 88.0];
        let k = edges.len().min(n);
        x[..k].copy_from_slice(&edges[..k]);
        let a = noise(n, 2);
        for sigmoid in [false, true] {
            let name = if sigmoid { "sigmoid" } else { "ELU" };
            let gpu = eval::<WgpuAutodiff>(&device, FloatDType::F32, sigmoid, &x, &a, rows);
            let want = eval::<Autodiff<NdArray<f64>>>(
                &Default::default(),
                FloatDType::F64,
                sigmoid,
                &x,
                &a,
                rows,
            );
            // 1e-4 relative; the 1e-30 floor is for values float32 rounds to zero
            // (sigmoid(-100) = 3.7e-44).
            for (what, got, want) in [("value", &gpu.0, &want.0), ("gradient", &gpu.1, &want.1)] {
                for (i, (g, w)) in got.iter().zip(want.iter()).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-4 * w.abs() + 1e-30,
                        "{name} {what} [{rows} x {cols}] at x = {}: GPU {g}, f64 {w}",
                        x[i]
                    );
                }
            }
        }
    }
}

/// The float16 kernels (float16 tensors throughout, and mixed precision's path: float32 in
/// and out, the casts inside the kernels) against burn's autodiff of the composed forms in
/// f64 on the same float16-rounded inputs, for a batch of 1 and 481 values, arguments out
/// to ±10: values to `4e-3 |f64| + 1e-4` (float16 keeps 11
/// significant bits, 4.9e-4 relative, and goes subnormal below 6.1e-5); gradients to
/// `4e-3 |f64| + 1e-3 |a|` (`a` the incoming gradient), because the slope comes from the
/// float16 output (`y + 1`, `s (1 - s)`, as the composed float16 forms compute it), whose
/// error is an ulp of 1, not of the slope.
#[test]
fn gpu_float16_activation_kernels_match_the_composed_forms() {
    crate::common::cpu_default_f32();
    let device = wgpu_device(0).expect("a Vulkan adapter (lavapipe)");
    let half = |v: Vec<f32>| -> Vec<f32> {
        v.iter()
            .map(|&x| burn::tensor::f16::from_f32(x).to_f32())
            .collect()
    };
    for (rows, cols) in [(1, 7), (37, 13)] {
        let n = rows * cols;
        let mut x: Vec<f32> = noise(n, 5).iter().map(|v| v * 6.0).collect();
        let edges = [-10.0, 10.0, 0.0, -1e-3, 1e-3, 5.0, -0.4];
        let k = edges.len().min(n);
        x[..k].copy_from_slice(&edges[..k]);
        let (x, a) = (half(x), half(noise(n, 6)));
        for (sigmoid, mixed) in [(false, false), (true, false), (false, true), (true, true)] {
            // `mixed`: mixed precision's path, float32 in and out with the casts inside the
            // kernels (`FusedOps::activation_half`); else float16 tensors throughout.
            let gpu = if mixed {
                let t = |v: &[f32]| {
                    Tensor::<WgpuAutodiff, 2>::from_data(
                        TensorData::new(v.to_vec(), [rows, cols]),
                        &device,
                    )
                };
                let xt = t(&x).require_grad();
                let y = if sigmoid {
                    WgpuAutodiff::sigmoid_at(xt.clone(), Precision::Half)
                } else {
                    WgpuAutodiff::elu_at(xt.clone(), Precision::Half)
                };
                assert_eq!(y.dtype(), burn::tensor::DType::F32);
                let grads = (y.clone() * t(&a)).sum().backward();
                let v = |d: TensorData| -> Vec<f64> { d.convert::<f64>().to_vec().unwrap() };
                (v(y.into_data()), v(xt.grad(&grads).unwrap().into_data()))
            } else {
                eval::<WgpuAutodiff>(&device, FloatDType::F16, sigmoid, &x, &a, rows)
            };
            let want = eval::<Autodiff<NdArray<f64>>>(
                &Default::default(),
                FloatDType::F64,
                sigmoid,
                &x,
                &a,
                rows,
            );
            for (what, got, want) in [("value", &gpu.0, &want.0), ("gradient", &gpu.1, &want.1)] {
                for (i, (g, w)) in got.iter().zip(want.iter()).enumerate() {
                    let floor = if what == "value" {
                        1e-4
                    } else {
                        1e-3 * a[i].abs() as f64
                    };
                    assert!(
                        (g - w).abs() <= 4e-3 * w.abs() + floor,
                        "float16 {} {what} at x = {}: GPU {g}, f64 {w}",
                        if sigmoid { "sigmoid" } else { "ELU" },
                        x[i]
                    );
                }
            }
        }
    }
}

/// Which layer kernel a comparison runs ([`FusedOps::LAYER_KERNELS`]).
#[derive(Debug, Clone, Copy)]
enum Layer {
    /// LayerNorm, then ELU when true.
    Norm(bool),
    /// `elu(x Wᵀ + b)`.
    LinearElu,
    /// The gated residual tail `x + (t W₁ᵀ + b₁) sigmoid(context W_cᵀ + b_c)`.
    Gated,
}

/// The output and the gradient of every input for `L = Σ a y`: `inputs` are the layer's
/// inputs in its argument order, each `(values, shape)` (a 1-element shape for a vector).
fn eval_layer<B: AutodiffBackend + FusedOps>(
    device: &B::Device,
    dtype: FloatDType,
    layer: Layer,
    inputs: &[(Vec<f32>, Vec<usize>)],
    a: &[f32],
) -> Vec<Vec<f64>> {
    let m = |i: usize| {
        let (v, s) = &inputs[i];
        Tensor::<B, 2>::from_data(TensorData::new(v.clone(), [s[0], s[1]]), device)
            .cast(dtype)
            .require_grad()
    };
    let v = |i: usize| {
        let (v, s) = &inputs[i];
        Tensor::<B, 1>::from_data(TensorData::new(v.clone(), [s[0]]), device)
            .cast(dtype)
            .require_grad()
    };
    let v64 = |d: TensorData| -> Vec<f64> { d.convert::<f64>().to_vec().unwrap() };
    let (y, mats, vecs) = match layer {
        Layer::Norm(elu) => {
            let (x, w, b) = (m(0), v(1), v(2));
            let y = B::fused_layer_norm(x.clone(), w.clone(), b.clone(), 1e-5, elu);
            (y, vec![x], vec![w, b])
        }
        Layer::LinearElu => {
            let (x, w, b) = (m(0), v(1), v(2));
            (
                B::linear_elu(x.clone(), w.clone(), b.clone()),
                vec![x],
                vec![w, b],
            )
        }
        Layer::Gated => {
            let (x, t, w1, b1, c, wc, bc) = (m(0), m(1), v(2), v(3), m(4), v(5), v(6));
            let y = B::gated_residual(
                x.clone(),
                t.clone(),
                w1.clone(),
                b1.clone(),
                c.clone(),
                wc.clone(),
                bc.clone(),
            );
            (y, vec![x, t, c], vec![w1, b1, wc, bc])
        }
    };
    let [rows, cols] = y.dims();
    let at =
        Tensor::<B, 2>::from_data(TensorData::new(a.to_vec(), [rows, cols]), device).cast(dtype);
    let grads = (y.clone() * at).sum().backward();
    let mut out = vec![v64(y.into_data())];
    out.extend(
        mats.iter()
            .map(|t| v64(t.grad(&grads).unwrap().into_data())),
    );
    out.extend(
        vecs.iter()
            .map(|t| v64(t.grad(&grads).unwrap().into_data())),
    );
    out
}

/// Asserts `got` within 1e-4 of `want` relative to `max(|want_i|, mean |want|)`: the mean
/// magnitude floors the scale where an entry is a cancellation's small remainder (a
/// LayerNorm gradient's entries sum to zero over a row).
fn assert_close(what: &str, got: &[f64], want: &[f64]) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let mean = want.iter().map(|w| w.abs()).sum::<f64>() / want.len().max(1) as f64;
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let scale = w.abs().max(mean).max(1e-30);
        assert!(
            (g - w).abs() <= 1e-4 * scale,
            "{what} [{i}]: GPU {g}, f64 {w} (scale {scale:e})"
        );
    }
}

/// The layer kernels (`layer_kernel.rs`: LayerNorm with and without ELU, the bias with
/// ELU after a product, the gated residual tail) against burn's autodiff of the composed
/// forms in f64: values and every input's gradient, for a batch of 1, a batch that is no
/// multiple of a workgroup, a LayerNorm row of equal values and pre-activations up to ±100.
#[test]
fn gpu_layer_kernels_match_the_composed_forms_and_their_gradients() {
    crate::common::cpu_default_f32();
    const {
        assert!(<WgpuAutodiff as FusedOps>::LAYER_KERNELS);
        assert!(!<Autodiff<NdArray<f64>> as FusedOps>::LAYER_KERNELS);
    }
    let device = wgpu_device(0).expect("a Vulkan adapter (lavapipe)");
    let cpu = Default::default();
    let mut seed = 10;
    let mut noise_of = |n: usize, scale: f32| {
        seed += 1;
        noise(n, seed)
            .iter()
            .map(|v| v * scale)
            .collect::<Vec<f32>>()
    };
    // (rows, features, inputs): a batch of one, 67 rows (no multiple of a workgroup).
    for (rows, f, k) in [(1, 7, 5), (67, 19, 11)] {
        let mut x = noise_of(rows * f, 3.0);
        if rows > 1 {
            // A row of equal values (variance 0), and one of large values.
            x[f..2 * f].fill(2.5);
            x[2 * f..3 * f].iter_mut().for_each(|v| *v *= 40.0);
        }
        let w = noise_of(f, 1.5);
        let b = noise_of(f, 1.0);
        let a = noise_of(rows * f, 1.0);
        let norm = vec![
            (x.clone(), vec![rows, f]),
            (w.clone(), vec![f]),
            (b.clone(), vec![f]),
        ];
        // Products up to about ±100: ELU's and the sigmoid's saturated ends.
        let xin = noise_of(rows * k, 10.0);
        let lin = vec![
            (xin.clone(), vec![rows, k]),
            (noise_of(f * k, 2.0), vec![f * k]),
            (noise_of(f, 1.0), vec![f]),
        ];
        let gated = vec![
            (x.clone(), vec![rows, f]),
            (noise_of(rows * f, 6.0), vec![rows, f]),
            (noise_of(f * f, 1.0), vec![f * f]),
            (noise_of(f, 1.0), vec![f]),
            (xin, vec![rows, k]),
            (noise_of(f * k, 2.0), vec![f * k]),
            (noise_of(f, 1.0), vec![f]),
        ];
        let cases = [
            (Layer::Norm(true), &norm),
            (Layer::Norm(false), &norm),
            (Layer::LinearElu, &lin),
            (Layer::Gated, &gated),
        ];
        for (layer, inputs) in cases {
            let gpu = eval_layer::<WgpuAutodiff>(&device, FloatDType::F32, layer, inputs, &a);
            let want =
                eval_layer::<Autodiff<NdArray<f64>>>(&cpu, FloatDType::F64, layer, inputs, &a);
            for (i, (g, w)) in gpu.iter().zip(&want).enumerate() {
                let what = if i == 0 {
                    "value".into()
                } else {
                    format!("gradient {i}")
                };
                assert_close(&format!("{layer:?} [{rows} x {f}] {what}"), g, w);
            }
        }
        // Without autodiff (evaluation passes) LayerNorm gives the same values.
        let t = |v: &[f32], s: [usize; 2]| {
            Tensor::<WgpuBackend, 2>::from_data(TensorData::new(v.to_vec(), s), &device)
        };
        let vct = |v: &[f32]| {
            Tensor::<WgpuBackend, 1>::from_data(TensorData::new(v.to_vec(), [v.len()]), &device)
        };
        let y = WgpuBackend::fused_layer_norm(t(&x, [rows, f]), vct(&w), vct(&b), 1e-5, true);
        let y: Vec<f64> = y.into_data().convert::<f64>().to_vec().unwrap();
        let want =
            eval_layer::<WgpuAutodiff>(&device, FloatDType::F32, Layer::Norm(true), &norm, &a);
        assert_eq!(y, want[0]);
    }
}

/// `(Wᵀ, lu_logdet(acc), dL/dlower, dL/dupper, dL/ddiag, dL/dacc)` for
/// `L = Σ a Wᵀ + Σ c logdet` (see [`FusedOps::lu_weight_t`], [`FusedOps::lu_logdet`]).
fn eval_lu<B: AutodiffBackend + FusedOps>(
    device: &B::Device,
    dtype: FloatDType,
    params: [&[f32]; 4],
    a: &[f32],
    c: &[f32],
) -> Vec<Vec<f64>> {
    let v = |v: &[f32]| {
        Tensor::<B, 1>::from_data(TensorData::new(v.to_vec(), [v.len()]), device)
            .cast(dtype)
            .require_grad()
    };
    let [lower, upper, diag, acc] = params.map(v);
    let n = diag.dims()[0];
    let wt = B::lu_weight_t(lower.clone(), upper.clone(), diag.clone(), 1e-3);
    let ld = B::lu_logdet(acc.clone(), diag.clone(), 1e-3);
    let at = Tensor::<B, 2>::from_data(TensorData::new(a.to_vec(), [n, n]), device).cast(dtype);
    let ct = Tensor::<B, 1>::from_data(TensorData::new(c.to_vec(), [c.len()]), device).cast(dtype);
    let grads = ((wt.clone() * at).sum() + (ld.clone() * ct).sum()).backward();
    let v64 = |d: TensorData| -> Vec<f64> { d.convert::<f64>().to_vec().unwrap() };
    let mut out = vec![v64(wt.into_data()), v64(ld.into_data())];
    for t in [&lower, &upper, &diag, &acc] {
        out.push(v64(t.grad(&grads).unwrap().into_data()));
    }
    out
}

/// The LU map's kernels (`lu_kernel.rs`: its weight, its log-determinant) against burn's
/// autodiff of the composed forms in f64, for `n = 2` and `n = 6`, a batch of 1 and of 67,
/// with unconstrained diagonal entries out to ±30 (softplus's saturated ends).
#[test]
fn gpu_lu_kernels_match_the_composed_forms_and_their_gradients() {
    crate::common::cpu_default_f32();
    let device = wgpu_device(0).expect("a Vulkan adapter (lavapipe)");
    for (n, rows) in [(2usize, 1usize), (6, 67)] {
        let t = n * (n - 1) / 2;
        let lower = noise(t, 31 + n as u64);
        let upper: Vec<f32> = noise(t, 32 + n as u64).iter().map(|v| v * 2.0).collect();
        let mut diag: Vec<f32> = noise(n, 33 + n as u64).iter().map(|v| v * 3.0).collect();
        diag[0] = -30.0;
        diag[n - 1] = 30.0;
        let acc = noise(rows, 34);
        let a = noise(n * n, 35);
        let c = noise(rows, 36);
        let params = [&lower[..], &upper[..], &diag[..], &acc[..]];
        let gpu = eval_lu::<WgpuAutodiff>(&device, FloatDType::F32, params, &a, &c);
        let want =
            eval_lu::<Autodiff<NdArray<f64>>>(&Default::default(), FloatDType::F64, params, &a, &c);
        let names = ["Wᵀ", "logdet", "dlower", "dupper", "ddiag", "dacc"];
        for ((g, w), name) in gpu.iter().zip(&want).zip(names) {
            assert_close(&format!("LU n = {n}, {rows} rows: {name}"), g, w);
        }
    }
}

/// `(place(x_id, both), logdet(acc, both), dL/dx_id, dL/dboth, dL/dacc)` for
/// `L = Σ a place + Σ c logdet` (see [`FusedOps::coupling_place`],
/// [`FusedOps::coupling_logdet`]).
#[allow(clippy::too_many_arguments)]
fn eval_coupling<B: AutodiffBackend + FusedOps>(
    device: &B::Device,
    dtype: FloatDType,
    (rows, d, start): (usize, usize, usize),
    x_id: &[f32],
    both: &[f32],
    acc: &[f32],
    a: &[f32],
    c: &[f32],
) -> Vec<Vec<f64>> {
    let t = both.len() / 2 / rows;
    let m = |v: &[f32], s: [usize; 2]| {
        Tensor::<B, 2>::from_data(TensorData::new(v.to_vec(), s), device).cast(dtype)
    };
    let (xt, bt) = (
        m(x_id, [rows, d - t]).require_grad(),
        m(both, [rows * t, 2]).require_grad(),
    );
    let acct = Tensor::<B, 1>::from_data(TensorData::new(acc.to_vec(), [rows]), device)
        .cast(dtype)
        .require_grad();
    let z = B::coupling_place(xt.clone(), bt.clone(), start);
    let ld = B::coupling_logdet(acct.clone(), bt.clone());
    let ct = Tensor::<B, 1>::from_data(TensorData::new(c.to_vec(), [rows]), device).cast(dtype);
    let grads = ((z.clone() * m(a, [rows, d])).sum() + (ld.clone() * ct).sum()).backward();
    let v64 = |d: TensorData| -> Vec<f64> { d.convert::<f64>().to_vec().unwrap() };
    vec![
        v64(z.into_data()),
        v64(ld.into_data()),
        v64(xt.grad(&grads).unwrap().into_data()),
        v64(bt.grad(&grads).unwrap().into_data()),
        v64(acct.grad(&grads).unwrap().into_data()),
    ]
}

/// The end of a coupling step as kernels (`coupling_kernel.rs`: the features placed back in
/// order, the spline's log-derivatives added to the log-determinant) against burn's
/// autodiff of the composed forms in f64: both masks, 5 and 2 features, a batch of 1 and
/// of 67.
#[test]
fn gpu_coupling_kernels_match_the_composed_forms_and_their_gradients() {
    crate::common::cpu_default_f32();
    let device = wgpu_device(0).expect("a Vulkan adapter (lavapipe)");
    for (rows, d) in [(1usize, 5usize), (67, 5), (67, 2)] {
        for start in [0, 1] {
            let t = (d - start).div_ceil(2);
            let x_id = noise(rows * (d - t), 41);
            let both = noise(rows * t * 2, 42);
            let acc = noise(rows, 43);
            let a = noise(rows * d, 44);
            let c = noise(rows, 45);
            let shape = (rows, d, start);
            let run = |gpu: bool| {
                if gpu {
                    eval_coupling::<WgpuAutodiff>(
                        &device,
                        FloatDType::F32,
                        shape,
                        &x_id,
                        &both,
                        &acc,
                        &a,
                        &c,
                    )
                } else {
                    eval_coupling::<Autodiff<NdArray<f64>>>(
                        &Default::default(),
                        FloatDType::F64,
                        shape,
                        &x_id,
                        &both,
                        &acc,
                        &a,
                        &c,
                    )
                }
            };
            let (gpu, want) = (run(true), run(false));
            let names = ["z", "logdet", "dx_id", "dboth", "dacc"];
            for ((g, w), name) in gpu.iter().zip(&want).zip(names) {
                assert_close(
                    &format!("coupling {rows} x {d}, start {start}: {name}"),
                    g,
                    w,
                );
            }
        }
    }
}
