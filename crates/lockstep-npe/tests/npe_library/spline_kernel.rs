//! The coupling spline's GPU kernels (`spline_kernel.rs`, one launch forward and one
//! backward) against burn's autodiff of the composed spline, on the machine's Vulkan
//! adapter (Mesa's lavapipe in CI; no adapter is a failure, never a skip): values and
//! gradients with respect to the input and every raw parameter (and the values without
//! autodiff, as evaluation passes run them), on the f64 reference, with
//! inputs inside the tails, on both tail bounds, outside them, and with large raw values.
//!
//! The evaluations are lockstep_npe::kernel_check's non-generic entries (see
//! activation_kernel.rs).

use lockstep_npe::device::wgpu_device;
use lockstep_npe::kernel_check::{self, Engine, SplineCase};
use lockstep_npe::spline::SplineParams;

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

    let case = SplineCase {
        x: x.clone(),
        raw,
        a: a.clone(),
        b,
        scale,
        sp,
    };
    let device = wgpu_device(0).unwrap();
    let gpu = Engine::Gpu {
        device: &device,
        half: false,
    };
    let gpu = kernel_check::spline(gpu, &case);
    let f64_ref = kernel_check::spline(Engine::CpuF64, &case);
    let cpu = kernel_check::spline(Engine::CpuF32, &case);
    let (_, gpu_spline, _, cpu_spline) = kernel_check::kernel_flags();
    assert!(gpu_spline && !cpu_spline);

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
    let (y, ld) = kernel_check::spline_inference(&device, &case);
    assert_eq!((y, ld), (gpu.y.clone(), gpu.ld.clone()));
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

/// The spline reading its inputs from the flow state `[rows, d + 2]` (the transformed
/// columns of Dingo's alternating masks) and writing the state's gradient: the same values
/// and gradients as the flat kernel on those columns, zeros in the other columns (which the
/// backward kernel writes itself), and the f64 reference to 1e-4, also with the
/// conditioner's final bias added in the kernel; θ of 5 and of 2 components, both masks, a
/// batch of 1 and of 67.
#[test]
fn gpu_spline_kernels_read_the_flow_state() {
    crate::common::cpu_default_f32();
    let sp = SplineParams::new(8, 3.0);
    let width = 3 * sp.num_bins - 1;
    let scale = 1.0 / 16f64.sqrt();
    let device = wgpu_device(0).unwrap();
    let gpu = Engine::Gpu {
        device: &device,
        half: false,
    };
    for (rows, d) in [(1usize, 5usize), (67, 5), (67, 2)] {
        for start in [0, 1] {
            let w = d + 2;
            let cols: Vec<usize> = (start..d).step_by(2).collect();
            let t = cols.len();
            let m = rows * t;
            // Non-zero everywhere, so that a missing zero in the gradient shows.
            let state: Vec<f32> = noise(rows * w, 7 + d as u64)
                .iter()
                .map(|v| v * 3.6)
                .collect();
            let case = SplineCase {
                x: state.clone(),
                raw: noise(m * width, 8).iter().map(|v| v * 4.0).collect(),
                a: noise(m, 9),
                b: noise(m, 10),
                scale,
                sp,
            };
            let (got, _) = kernel_check::spline_on_state(gpu, &case, rows, start, None);
            let (want, _) = kernel_check::spline_on_state(Engine::CpuF64, &case, rows, start, None);
            let what = format!("{rows} x {d}, start {start}");
            for (name, g, w) in [
                ("y", &got.y, &want.y),
                ("log|dy/dx|", &got.ld, &want.ld),
                ("dL/dstate", &got.gx, &want.gx),
                ("dL/draw", &got.graw, &want.graw),
            ] {
                let e = worst(g, w);
                assert!(e <= 1e-4, "{what}: {name} off the f64 reference by {e:e}");
            }
            // The flat kernel on the gathered columns gives the same bits.
            let flat = SplineCase {
                x: (0..m).map(|i| state[(i / t) * w + cols[i % t]]).collect(),
                ..case.clone()
            };
            let flat = kernel_check::spline(gpu, &flat);
            assert_eq!(
                (&got.y, &got.ld, &got.graw),
                (&flat.y, &flat.ld, &flat.graw)
            );
            for r in 0..rows {
                for f in 0..w {
                    let g = got.gx[r * w + f];
                    match cols.iter().position(|&c| c == f) {
                        Some(j) => assert_eq!(g, flat.gx[r * t + j], "{what}: row {r} col {f}"),
                        None => assert_eq!(g, 0.0, "{what}: row {r} col {f}"),
                    }
                }
            }
            // The conditioner's final bias added in the kernel: as if added to raw first,
            // and its gradient the column sums of raw's.
            let bias: Vec<f32> = noise(t * width, 11).iter().map(|v| v * 2.0).collect();
            let (with, gbias) = kernel_check::spline_on_state(gpu, &case, rows, start, Some(&bias));
            let (want, want_gbias) =
                kernel_check::spline_on_state(Engine::CpuF64, &case, rows, start, Some(&bias));
            let (gbias, want_gbias) = (gbias.unwrap(), want_gbias.unwrap());
            for (name, g, w) in [
                ("y", &with.y, &want.y),
                ("log|dy/dx|", &with.ld, &want.ld),
                ("dL/dstate", &with.gx, &want.gx),
                ("dL/draw", &with.graw, &want.graw),
                ("dL/dbias", &gbias, &want_gbias),
            ] {
                let e = worst(g, w);
                assert!(
                    e <= 1e-4,
                    "{what}, biased: {name} off the f64 reference by {e:e}"
                );
            }
            let added = SplineCase {
                raw: (0..m * width)
                    .map(|i| case.raw[i] + bias[((i / width) % t) * width + i % width])
                    .collect(),
                ..case.clone()
            };
            let (plain, _) = kernel_check::spline_on_state(gpu, &added, rows, start, None);
            assert_eq!((&with.y, &with.ld), (&plain.y, &plain.ld), "{what}");
        }
    }
}
