//! ELU and the sigmoid as GPU kernels (`activation_kernel.rs`, one launch forward and one
//! backward each) against burn's autodiff of the composed forms in f64, on the machine's
//! Vulkan adapter (Mesa's lavapipe in CI; no adapter is a failure, never a skip): values
//! and gradients, for a batch of 1 and a batch whose element count is no multiple of a
//! workgroup, with arguments from -100 to 100 (exp's overflow and underflow, the kink at 0).
//!
//! The evaluations are lockstep_npe::kernel_check's non-generic entries: naming burn's
//! backends here would compile burn's autodiff and kernels again for this binary.

use lockstep_npe::device::wgpu_device;
use lockstep_npe::kernel_check::{self, CouplingCase, CouplingShape, Engine, Layer};

/// `v` rounded to float16 (and back to float32).
fn half(v: Vec<f32>) -> Vec<f32> {
    v.iter()
        .map(|&x| burn::tensor::f16::from_f32(x).to_f32())
        .collect()
}

/// The GPU engine in float32.
fn gpu_f32(device: &burn::backend::wgpu::WgpuDevice) -> Engine<'_> {
    Engine::Gpu {
        device,
        half: false,
    }
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
            let gpu = kernel_check::activation(gpu_f32(&device), sigmoid, &x, &a, rows);
            let want = kernel_check::activation(Engine::CpuF64, sigmoid, &x, &a, rows);
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
    for (rows, cols) in [(1, 7), (37, 13)] {
        let n = rows * cols;
        let mut x: Vec<f32> = noise(n, 5).iter().map(|v| v * 6.0).collect();
        let edges = [-10.0, 10.0, 0.0, -1e-3, 1e-3, 5.0, -0.4];
        let k = edges.len().min(n);
        x[..k].copy_from_slice(&edges[..k]);
        let (x, a) = (half(x), half(noise(n, 6)));
        for (sigmoid, mixed) in [(false, false), (true, false), (false, true), (true, true)] {
            // `mixed`: mixed precision's path, float32 in, the casts inside the kernels
            // (`FusedOps::activation_half`; the sigmoid returns float32, the ELU float16);
            // else float16 tensors throughout.
            let gpu = if mixed {
                kernel_check::activation_mixed(&device, sigmoid, &x, &a, rows)
            } else {
                let half = Engine::Gpu {
                    device: &device,
                    half: true,
                };
                kernel_check::activation(half, sigmoid, &x, &a, rows)
            };
            let want = kernel_check::activation(Engine::CpuF64, sigmoid, &x, &a, rows);
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
/// ELU after a product, the gated residual tail with the context's product inside, a
/// residual block's end) against burn's autodiff of the composed
/// forms in f64: values and every input's gradient, for a batch of 1, a batch that is no
/// multiple of a workgroup, a LayerNorm row of equal values and pre-activations up to ±100.
#[test]
fn gpu_layer_kernels_match_the_composed_forms_and_their_gradients() {
    crate::common::cpu_default_f32();
    let (gpu_layers, _, cpu_layers, _) = kernel_check::kernel_flags();
    assert!(gpu_layers && !cpu_layers);
    let device = wgpu_device(0).expect("a Vulkan adapter (lavapipe)");
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
            (xin.clone(), vec![rows, k]),
            (noise_of(f * k, 2.0), vec![f * k]),
            (noise_of(f, 1.0), vec![f]),
        ];
        let residual = vec![
            (x.clone(), vec![rows, f]),
            (xin, vec![rows, k]),
            (noise_of(f * k, 2.0), vec![f * k]),
            (noise_of(f, 1.0), vec![f]),
        ];
        let cases = [
            (Layer::Norm(true), &norm),
            (Layer::Norm(false), &norm),
            (Layer::LinearElu, &lin),
            (Layer::Gated, &gated),
            (Layer::Residual, &residual),
        ];
        for (layer, inputs) in cases {
            let gpu = kernel_check::layer(gpu_f32(&device), layer, inputs, &a);
            let want = kernel_check::layer(Engine::CpuF64, layer, inputs, &a);
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
        let y = kernel_check::layer_norm_inference(&device, &x, rows, &w, &b, true);
        let want = kernel_check::layer(gpu_f32(&device), Layer::Norm(true), &norm, &a);
        assert_eq!(y, want[0]);
    }
}

/// A flow step's LU map on the flow state as one kernel each way (`lu_kernel.rs`: the
/// matrix with the weight's rows, without and with the flow step's permutation folded in,
/// the bias and the log-determinant) against burn's autodiff of the composed form in f64,
/// for `n = 1`, `2` and `6`, with unconstrained diagonal entries out to ±30 (softplus's
/// saturated ends).
#[test]
fn gpu_lu_kernels_match_the_composed_forms_and_their_gradients() {
    crate::common::cpu_default_f32();
    let device = wgpu_device(0).expect("a Vulkan adapter (lavapipe)");
    for n in [1usize, 2, 6] {
        let t = n * (n - 1) / 2;
        let lower = noise(t, 31 + n as u64);
        let upper: Vec<f32> = noise(t, 32 + n as u64).iter().map(|v| v * 2.0).collect();
        let mut diag: Vec<f32> = noise(n, 33 + n as u64).iter().map(|v| v * 3.0).collect();
        diag[0] = -30.0;
        diag[n - 1] = 30.0;
        let bias = noise(n, 34);
        let w = n + 2;
        let a = noise(w * w, 35);
        let params = [&lower[..], &upper[..], &diag[..], &bias[..]];
        // Unpermuted, and with the flow step's permutation folded into the weight's rows.
        let rotated: Vec<usize> = (0..n).map(|j| (j + 1) % n).collect();
        for perm in [None, Some(&rotated[..])] {
            let gpu = kernel_check::lu(gpu_f32(&device), params, perm, &a);
            let want = kernel_check::lu(Engine::CpuF64, params, perm, &a);
            let names = ["A", "dlower", "dupper", "ddiag", "dbias"];
            for ((g, w), name) in gpu.iter().zip(&want).zip(names) {
                assert_close(&format!("LU n = {n}, {perm:?}: {name}"), g, w);
            }
        }
        // The permuted map is the unpermuted one with the weight's rows moved,
        // A[perm[j]] = Wᵀ[j], and the same last two rows.
        let plain = kernel_check::lu(gpu_f32(&device), params, None, &a);
        let moved = kernel_check::lu(gpu_f32(&device), params, Some(&rotated), &a);
        for j in 0..n {
            let p = rotated[j];
            assert_eq!(plain[0][j * w..(j + 1) * w], moved[0][p * w..(p + 1) * w]);
        }
        assert_eq!(plain[0][n * w..], moved[0][n * w..]);
    }
}

/// A coupling step's input and end on the flow state as kernels (`coupling_kernel.rs`: the
/// untransformed features next to the context; the features placed back in order, the
/// spline's log-derivatives added to the log-determinant) against burn's autodiff of the
/// composed forms in f64: both masks, 5, 2 and 1 features, a batch of 1 and of 67.
#[test]
fn gpu_coupling_kernels_match_the_composed_forms_and_their_gradients() {
    crate::common::cpu_default_f32();
    let device = wgpu_device(0).expect("a Vulkan adapter (lavapipe)");
    for (rows, d) in [(1usize, 5usize), (67, 5), (67, 2), (3, 1)] {
        for start in [0, 1] {
            let shape = CouplingShape {
                rows,
                d,
                c: 3,
                start,
            };
            let t = shape.transformed();
            if t == 0 {
                continue;
            }
            let case = CouplingCase {
                shape,
                state: noise(rows * (d + 2), 41),
                ctx: noise(rows * 3, 46),
                both: noise(rows * t * 2, 42),
                a_split: noise(rows * (d - t + 3), 44),
                a_place: noise(rows * (d + 2), 45),
            };
            let (gpu, want) = (
                kernel_check::coupling(gpu_f32(&device), &case),
                kernel_check::coupling(Engine::CpuF64, &case),
            );
            let names = ["input", "next state", "dstate", "dctx", "dboth"];
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

/// The flow's base log-density with its log-determinant from the flow state
/// (`coupling_kernel.rs`: one launch each way) against burn's autodiff of the composed form
/// in f64: a batch of 1 and of 67, θ of 5 and of 1 component, values up to ±40 (squares of
/// 1600).
#[test]
fn gpu_base_log_prob_kernel_matches_the_composed_form_and_its_gradients() {
    crate::common::cpu_default_f32();
    let device = wgpu_device(0).expect("a Vulkan adapter (lavapipe)");
    for (rows, d) in [(1usize, 5usize), (67, 5), (67, 1)] {
        let w = d + 2;
        let mut state: Vec<f32> = noise(rows * w, 51).iter().map(|v| v * 4.0).collect();
        state[0] = 40.0;
        for r in 0..rows {
            state[r * w + d] *= 2.5;
            state[r * w + d + 1] = 1.0;
        }
        let a = noise(rows, 53);
        let constants = (0.5 * d as f64 * (2.0 * std::f64::consts::PI).ln(), 1.7);
        let run = |engine| kernel_check::base_log_prob(engine, &state, &a, constants);
        let (gpu, want) = (run(gpu_f32(&device)), run(Engine::CpuF64));
        for ((g, w), name) in gpu.iter().zip(&want).zip(["lp", "dstate"]) {
            assert_close(&format!("base log-density {rows} x {d}: {name}"), g, w);
        }
    }
}

/// Mixed precision's gated tail (the block's product in float16, the context's product,
/// the gate and the tail in the float32 kernel) against burn's autodiff of the float32 form
/// in f64 on float16-rounded inputs, for a batch of 1 and of 67: output and every gradient
/// to `8e-3` of the larger of the value and the mean magnitude.
#[test]
fn gpu_mixed_precision_gated_tail_matches_the_float32_form() {
    crate::common::cpu_default_f32();
    let device = wgpu_device(0).expect("a Vulkan adapter (lavapipe)");
    for (rows, f, k) in [(1usize, 7usize, 5usize), (67, 19, 11)] {
        let m = |n: usize, seed: u64, scale: f32| {
            half(noise(n, seed).iter().map(|v| v * scale).collect())
        };
        let gated = vec![
            (m(rows * f, 71, 3.0), vec![rows, f]),
            (m(rows * f, 72, 2.0), vec![rows, f]),
            (m(f * f, 73, 0.5), vec![f * f]),
            (m(f, 74, 1.0), vec![f]),
            (m(rows * k, 75, 2.0), vec![rows, k]),
            (m(f * k, 76, 0.5), vec![f * k]),
            (m(f, 77, 1.0), vec![f]),
        ];
        let a = m(rows * f, 78, 1.0);
        let gpu = kernel_check::layer_mixed(&device, Layer::Gated, &gated, &a);
        let want = kernel_check::layer(Engine::CpuF64, Layer::Gated, &gated, &a);
        let names = ["y", "dx", "dt", "dcontext", "dW1", "db1", "dWc", "dbc"];
        assert_mixed_close(
            &gpu,
            &want,
            &names,
            &format!("mixed gated tail [{rows} x {f}]"),
        );
    }
}

/// Mixed precision's outputs `got` against the f64 reference `want`, output by output
/// (`names`, one per output): each value within `8e-3` of the larger of the reference value
/// and the output's mean magnitude.
fn assert_mixed_close(got: &[Vec<f64>], want: &[Vec<f64>], names: &[&str], what: &str) {
    assert_eq!(
        (got.len(), want.len()),
        (names.len(), names.len()),
        "{what}: outputs"
    );
    for ((g, w), name) in got.iter().zip(want).zip(names) {
        assert_eq!(g.len(), w.len(), "{what}: {name}");
        let mean = w.iter().map(|v| v.abs()).sum::<f64>() / w.len() as f64;
        for (i, (g, w)) in g.iter().zip(w).enumerate() {
            assert!(
                (g - w).abs() <= 8e-3 * w.abs().max(mean),
                "{what}, {name}[{i}]: GPU {g}, f64 {w}"
            );
        }
    }
}

/// Mixed precision's linear layer with its ELU (the flow's residual blocks: the float16
/// product, one kernel for the bias and the ELU in float16 with a float16 output, and
/// backward one kernel for the ELU's float16 gradient before the products) against burn's
/// autodiff of the float32 form in f64 on float16-rounded inputs, for a batch of 1 and of
/// 67, arguments out to about ±12 (ELU's saturation and its linear side): output and
/// gradients to `8e-3` of the larger of the value and the mean magnitude. On lavapipe the
/// kernel also gives the bits of the two operations it replaces (the linear layer casting
/// its own weight, then the ELU): fusing moved the casts, not the arithmetic.
#[test]
fn gpu_mixed_precision_linear_elu_kernel_matches_the_float32_form() {
    crate::common::cpu_default_f32();
    let device = wgpu_device(0).expect("a Vulkan adapter (lavapipe)");
    for (rows, k, f) in [(1usize, 7usize, 5usize), (67, 19, 11)] {
        let x = half(noise(rows * k, 81).iter().map(|v| v * 4.0).collect());
        let w = half(noise(f * k, 82));
        let b = half(noise(f, 83).iter().map(|v| v * 2.0).collect());
        let a = half(noise(rows * f, 84));
        let inputs = vec![(x, vec![rows, k]), (w, vec![f * k]), (b, vec![f])];
        let gpu = kernel_check::layer_mixed(&device, Layer::LinearElu, &inputs, &a);
        let unfused = kernel_check::layer_mixed(&device, Layer::LinearThenElu, &inputs, &a);
        assert_eq!(
            gpu, unfused,
            "[{rows} x {k}] -> {f}: one kernel and two operations"
        );
        let want = kernel_check::layer(Engine::CpuF64, Layer::LinearElu, &inputs, &a);
        let big = want[0].iter().filter(|v| v.abs() > 4.0).count();
        let saturated = want[0].iter().filter(|v| **v < -0.9).count();
        assert!(
            rows == 1 || (big > 0 && saturated > 0),
            "the arguments reach both sides"
        );
        let what = format!("mixed linear + ELU [{rows} x {k}] -> {f}");
        assert_mixed_close(&gpu, &want, &["y", "dx", "dW", "db"], &what);
    }
}

/// Mixed precision's linear layer (`linear_half_kernel.rs`: the float16 products, the bias
/// and every cast in two kernels around them) against burn's autodiff of the float32 form in
/// f64 on float16-rounded inputs, for a batch of 1 and of 67 (no multiple of a workgroup)
/// (the path without the input's gradient runs in npe_gpu's mixed-precision training, whose
/// first layer's input is data): output and gradients to `8e-3` of the larger
/// of the value and the output's mean magnitude (float16 keeps 11 significant bits; its
/// products round every partial sum).
#[test]
fn gpu_mixed_precision_linear_kernels_match_the_float32_form() {
    crate::common::cpu_default_f32();
    let device = wgpu_device(0).expect("a Vulkan adapter (lavapipe)");
    for (rows, k, f) in [(1usize, 7usize, 5usize), (67, 19, 11)] {
        let x = half(noise(rows * k, 61).iter().map(|v| v * 3.0).collect());
        let w = half(noise(f * k, 62));
        let b = half(noise(f, 63).iter().map(|v| v * 2.0).collect());
        let a = half(noise(rows * f, 64));
        let gpu = kernel_check::linear_mixed(&device, &x, rows, &w, &b, &a);
        let want = kernel_check::linear(Engine::CpuF64, &x, rows, &w, &b, &a);
        let what = format!("mixed linear [{rows} x {k}] -> {f}");
        assert_mixed_close(&gpu, &want, &["y", "dx", "dW", "db"], &what);
    }
}
