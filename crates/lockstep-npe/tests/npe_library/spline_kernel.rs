//! The coupling spline's GPU kernels (`spline_kernel.rs`, one launch forward and one
//! backward) against burn's autodiff of the composed spline, on the machine's Vulkan
//! adapter (Mesa's lavapipe in CI; no adapter is a failure, never a skip): values and
//! gradients with respect to the input and every raw parameter (and the values without
//! autodiff, as evaluation passes run them), on the f64 reference, with
//! inputs inside the tails, on both tail bounds, outside them, and with large raw values.

use burn::backend::{Autodiff, NdArray};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{FloatDType, Tensor, TensorData};
use lockstep_npe::device::{wgpu_device, WgpuAutodiff, WgpuBackend};
use lockstep_npe::fused_ops::FusedOps;
use lockstep_npe::spline::SplineParams;

/// Values and gradients of one evaluation: `y`, `log|dy/dx|`, `dL/dx`, `dL/draw` for
/// `L = Σ a y + Σ b log|dy/dx|`.
struct Eval {
    y: Vec<f64>,
    ld: Vec<f64>,
    gx: Vec<f64>,
    graw: Vec<f64>,
}

/// The inputs of one comparison: `x: [M]`, `raw: [M, 3K-1]`, the loss weights `a`, `b`
/// (`[M]` each), the width/height scale and the spline.
struct Case {
    x: Vec<f32>,
    raw: Vec<f32>,
    a: Vec<f32>,
    b: Vec<f32>,
    scale: f64,
    sp: SplineParams,
}

fn eval<B: AutodiffBackend + FusedOps>(device: &B::Device, dtype: FloatDType, c: &Case) -> Eval {
    let Case {
        x,
        raw,
        a,
        b,
        scale,
        sp,
    } = c;
    let m = x.len();
    let width = raw.len() / m;
    let t = |v: &[f32], cols: usize| {
        // burn keeps one default float dtype per device kind (NdArray<f32> and NdArray<f64>
        // share theirs), so the dtype is set explicitly.
        Tensor::<B, 2>::from_data(TensorData::new(v.to_vec(), [m, cols]), device).cast(dtype)
    };
    let xt = t(x, 1).require_grad();
    let rt = t(raw, width).require_grad();
    let (y, ld) = B::spline(xt.clone(), rt.clone(), *scale, sp);
    let loss = (y.clone() * t(a, 1)).sum() + (ld.clone() * t(b, 1)).sum();
    let grads = loss.backward();
    let v = |d: TensorData| -> Vec<f64> { d.convert::<f64>().to_vec().unwrap() };
    Eval {
        y: v(y.into_data()),
        ld: v(ld.into_data()),
        gx: v(xt.grad(&grads).unwrap().into_data()),
        graw: v(rt.grad(&grads).unwrap().into_data()),
    }
}

/// A deterministic pseudo-random sequence in [-1, 1).
fn noise(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f64 / (1u64 << 23) as f64 - 1.0) as f32
        })
        .collect()
}

/// The largest `|got - want| / (1 + |want|)`.
fn worst(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    got.iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / (1.0 + w.abs()))
        .fold(0.0, f64::max)
}

#[test]
fn gpu_spline_kernels_match_the_composed_spline_and_its_gradient() {
    crate::common::cpu_default_f32();
    let sp = SplineParams::new(8, 3.0);
    let k = sp.num_bins;
    let width = 3 * k - 1;
    let scale = 1.0 / 16f64.sqrt();
    let m = 3000;
    let mut x: Vec<f32> = noise(m, 1).iter().map(|v| v * 3.6).collect();
    // Both tail bounds exactly, just outside, the middle.
    x[..6].copy_from_slice(&[-3.0, 3.0, -3.0001, 3.0001, 0.0, 1e-7]);
    let mut raw: Vec<f32> = noise(m * width, 2).iter().map(|v| v * 4.0).collect();
    // Large raw values: a near-degenerate softmax and derivatives far into softplus's
    // linear part.
    for v in &mut raw[10 * width..12 * width] {
        *v *= 12.0;
    }
    let a = noise(m, 3);
    let b = noise(m, 4);

    let (f32_, f64_) = (FloatDType::F32, FloatDType::F64);
    let case = Case {
        x: x.clone(),
        raw,
        a: a.clone(),
        b,
        scale,
        sp,
    };
    let device = wgpu_device(0).unwrap();
    let gpu = eval::<WgpuAutodiff>(&device, f32_, &case);
    let cpu = Default::default();
    let f64_ref = eval::<Autodiff<NdArray<f64>>>(&cpu, f64_, &case);
    let cpu = eval::<Autodiff<NdArray<f32>>>(&cpu, f32_, &case);
    const {
        assert!(<WgpuAutodiff as FusedOps>::SPLINE_KERNEL);
        assert!(!<Autodiff<NdArray<f32>> as FusedOps>::SPLINE_KERNEL);
    }

    for (name, got, cpu, want) in [
        ("y", &gpu.y, &cpu.y, &f64_ref.y),
        ("log|dy/dx|", &gpu.ld, &cpu.ld, &f64_ref.ld),
        ("dL/dx", &gpu.gx, &cpu.gx, &f64_ref.gx),
        ("dL/draw", &gpu.graw, &cpu.graw, &f64_ref.graw),
    ] {
        let (wg, wc) = (worst(got, want), worst(cpu, want));
        eprintln!("{name}: GPU kernel {wg:e}, composed f32 on the CPU {wc:e} (vs f64)");
        assert!(
            wg <= 1e-4,
            "{name}: GPU kernel off the f64 reference by {wg:e}"
        );
    }
    // Without autodiff (evaluation passes: validation loss, log-probabilities) the forward
    // kernel alone gives the same values.
    let (y, ld) = <WgpuBackend as FusedOps>::spline(
        Tensor::from_data(TensorData::new(x.clone(), [m, 1]), &device),
        Tensor::from_data(TensorData::new(case.raw.clone(), [m, width]), &device),
        scale,
        &sp,
    );
    let v = |t: Tensor<WgpuBackend, 2>| -> Vec<f64> {
        t.into_data().convert::<f64>().to_vec().unwrap()
    };
    assert_eq!((v(y), v(ld)), (gpu.y.clone(), gpu.ld.clone()));
    // Outside the tails: the identity, no parameter gradient.
    for r in [2, 3] {
        assert_eq!(gpu.y[r], x[r] as f64);
        assert_eq!((gpu.ld[r], gpu.gx[r]), (0.0, a[r] as f64));
        assert!(gpu.graw[r * width..(r + 1) * width]
            .iter()
            .all(|&g| g == 0.0));
    }
    // Inside, every parameter group gets a gradient.
    let r = (6..m).find(|&r| x[r].abs() < 2.5).unwrap();
    let row = &gpu.graw[r * width..(r + 1) * width];
    for group in [&row[..k], &row[k..2 * k], &row[2 * k..]] {
        assert!(group.iter().any(|&g| g != 0.0), "{row:?}");
    }
}
