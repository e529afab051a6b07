//! ELU and the sigmoid as GPU kernels (`activation_kernel.rs`, one launch forward and one
//! backward each) against burn's autodiff of the composed forms in f64, on the machine's
//! Vulkan adapter (Mesa's lavapipe in CI; no adapter is a failure, never a skip): values
//! and gradients, for a batch of 1 and a batch whose element count is no multiple of a
//! workgroup, with arguments from -100 to 100 (exp's overflow and underflow, the kink at 0).

use burn::backend::{Autodiff, NdArray};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{FloatDType, Tensor, TensorData};
use lockstep_npe::device::{wgpu_device, WgpuAutodiff};
use lockstep_npe::fused_ops::FusedOps;

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
