//! Log-determinants of the spline and of the whole flow against numerical Jacobians, and the
//! model's parameter gradient against finite differences, in f64
//! (burn's ndarray backend with f64 elements; only f64 in this test binary).

// The helpers of the npe_library test binary (this one stays apart: its ndarray device is f64).
#[path = "npe_library/common.rs"]
mod common;

use common::{det3, random_params, random_splines, small_network, spline};
use lockstep_core::rng::SplitMix64;
use lockstep_npe::layers::Pass;
use lockstep_npe::params::Params;
use lockstep_npe::spline::SplineParams;
use lockstep_npe::{Norm, NpeModel};
use lockstep_train::Model;

type F64 = burn::backend::NdArray<f64>;

#[test]
fn log_det_matches_the_numerical_derivative() {
    let (k, bound) = (8, 2.0);
    let sp = SplineParams::new(k, bound);
    let (x, w, h_, d) = random_splines(500, k, bound, 2.0, 2);
    // Richardson extrapolation of central differences (error O(h⁴)), the step of each point
    // scaled to the map's local slope so the difference stays inside one bin.
    let derivative = |x: &[f64], slope_log: &[f64], inverse: bool| -> Vec<f64> {
        let at = |scale: f64| -> Vec<f64> {
            let h: Vec<f64> = slope_log
                .iter()
                .map(|l| scale * (-l.max(0.0)).exp())
                .collect();
            let xp: Vec<f64> = x.iter().zip(&h).map(|(v, h)| v + h).collect();
            let xm: Vec<f64> = x.iter().zip(&h).map(|(v, h)| v - h).collect();
            let (yp, _) = spline::<F64>(&xp, &w, &h_, &d, k, inverse, &sp);
            let (ym, _) = spline::<F64>(&xm, &w, &h_, &d, k, inverse, &sp);
            (0..x.len())
                .map(|i| (yp[i] - ym[i]) / (2.0 * h[i]))
                .collect()
        };
        let (c, f) = (at(2e-6), at(1e-6));
        f.iter().zip(&c).map(|(f, c)| (4.0 * f - c) / 3.0).collect()
    };
    let (y, ld) = spline::<F64>(&x, &w, &h_, &d, k, false, &sp);
    let (x_back, ld_inv) = spline::<F64>(&y, &w, &h_, &d, k, true, &sp);
    let dy = derivative(&x, &ld, false);
    let dx = derivative(&y, &ld_inv, true);
    let mut checked = 0;
    for i in 0..x.len() {
        assert!(
            (x_back[i] - x[i]).abs() <= 1e-10,
            "inverse: {} -> {} -> {}",
            x[i],
            y[i],
            x_back[i]
        );
        assert!(
            (ld[i] + ld_inv[i]).abs() <= 1e-8,
            "inverse log-det {} vs forward {}",
            ld_inv[i],
            ld[i]
        );
        if (x[i].abs() - bound).abs() < 1e-5 || (y[i].abs() - bound).abs() < 1e-5 {
            continue; // the derivative jumps where a knot meets a tail
        }
        let (nf, ni) = (dy[i].ln(), dx[i].ln());
        assert!(
            (nf - ld[i]).abs() <= 1e-4,
            "x {}: log|dy/dx| {} vs numerical {}",
            x[i],
            ld[i],
            nf
        );
        assert!(
            (ni - ld_inv[i]).abs() <= 1e-4,
            "y {}: log|dx/dy| {} vs numerical {}",
            y[i],
            ld_inv[i],
            ni
        );
        checked += 1;
    }
    assert!(checked > 450);
}

#[test]
fn flow_log_det_matches_the_numerical_jacobian() {
    let d = 3;
    let net = small_network(d, 2, Norm::LayerNorm, 2.5);
    let (p, mut st) = random_params(&net, 0.4, 3);
    let params = Params::<F64>::from_flat(net.layout(), &p, &Default::default());
    let mut pass = Pass::evaluation(&params, &mut st, net.state_layout());
    let x = [0.3f32, -0.7];
    let n = 20;
    let mut rng = SplitMix64::new(4);
    // θ on a dyadic grid and dyadic steps, so θ ± h is exact in f32 and Richardson
    // extrapolation of central differences (error O(h⁴)) applies exactly.
    let theta: Vec<f32> = (0..n * d)
        .map(|_| ((rng.normal() * 256.0).round() / 256.0) as f32)
        .collect();
    let ctx_rows: Vec<f32> = (0..n).flat_map(|_| x).collect();
    let context = net.context(&mut pass, &ctx_rows, n);
    let (_, ld) = net.transform(&mut pass, &theta, &context, n);
    let ld = ld.into_data().convert::<f64>().to_vec::<f64>().unwrap();
    let z_of = |pass: &mut Pass<'_, F64>, th: &[f32]| -> Vec<f64> {
        let (z, _) = net.transform(pass, th, &context, n);
        z.into_data().convert::<f64>().to_vec::<f64>().unwrap()
    };
    // jac[i][r][j] = ∂z_r/∂θ_j at point i, by central differences with step h.
    let mut jacobian = |h: f32| -> Vec<Vec<f64>> {
        let mut jac = vec![vec![0.0f64; d * d]; n];
        for j in 0..d {
            let (mut tp, mut tm) = (theta.clone(), theta.clone());
            for i in 0..n {
                tp[i * d + j] += h;
                tm[i * d + j] -= h;
            }
            let (zp, zm) = (z_of(&mut pass, &tp), z_of(&mut pass, &tm));
            for i in 0..n {
                for r in 0..d {
                    jac[i][r * d + j] = (zp[i * d + r] - zm[i * d + r]) / (2.0 * h as f64);
                }
            }
        }
        jac
    };
    let (coarse, fine) = (jacobian(1.0 / 512.0), jacobian(1.0 / 1024.0));
    for i in 0..n {
        let jac: Vec<f64> = fine[i]
            .iter()
            .zip(&coarse[i])
            .map(|(f, c)| (4.0 * f - c) / 3.0)
            .collect();
        let numerical = det3(&jac).abs().ln();
        assert!(
            (numerical - ld[i]).abs() <= 1e-4,
            "point {i}: log|det J| {} vs numerical {}",
            ld[i],
            numerical
        );
    }
}

/// The gradient the model hands the engine (autodiff, written into the flat buffer in layout
/// order) equals central differences of the batch's mean negative log-probability, for
/// parameters of every kind, with each normalization.
#[test]
fn gradient_matches_finite_differences() {
    type Ad64 = burn::backend::Autodiff<F64>;
    for norm in [Norm::None, Norm::LayerNorm, Norm::BatchNorm] {
        let net = small_network(3, 2, norm, 2.5);
        let (p, st) = random_params(&net, 0.1, 11);
        let mut model = NpeModel::<Ad64>::new(net.clone(), 0, Default::default());
        model.trainable_mut().copy_from_slice(&p);
        model.frozen_mut().copy_from_slice(&st);
        let n = 16;
        let mut rng = SplitMix64::new(12);
        let theta: Vec<f32> = (0..n * 3).map(|_| rng.normal() as f32).collect();
        let x: Vec<f32> = (0..n * 2).map(|_| rng.normal() as f32).collect();
        let mut grad = vec![0.0f32; p.len()];
        model.nll_and_grad(&theta, &x, n, &mut grad);

        let loss = |q: &[f32]| -> f64 {
            let params = Params::<F64>::from_flat(net.layout(), q, &Default::default());
            let mut state = st.clone();
            let mut pass = Pass {
                params: &params,
                state: &mut state,
                state_layout: net.state_layout(),
                training: true,
                sync: None,
            };
            let lp = net.log_prob(&mut pass, &theta, &x, n);
            -lp.mean()
                .into_data()
                .convert::<f64>()
                .to_vec::<f64>()
                .unwrap()[0]
        };
        // Two entries of every parameter tensor (first and last). The tolerance allows for
        // the loss's limited smoothness (the spline is C¹ in its knots, which move with the
        // parameters) and for burn computing sigmoid in f32 on every backend (loss noise
        // ~3e-7); a gradient written to the wrong place is off by O(1).
        let mut checked = 0;
        for spec in net.layout().specs() {
            for i in [spec.offset, spec.offset + spec.numel() - 1] {
                let h = 1.0 / 1024.0;
                let (mut qp, mut qm) = (p.clone(), p.clone());
                qp[i] += h;
                qm[i] -= h;
                let step = qp[i] as f64 - qm[i] as f64;
                let fd = (loss(&qp) - loss(&qm)) / step;
                let g = grad[i] as f64;
                assert!(
                    (fd - g).abs() <= 1e-2 * g.abs().max(fd.abs()) + 2e-3,
                    "{norm:?} {} [{}]: autodiff {g} vs finite differences {fd}",
                    spec.name,
                    i - spec.offset
                );
                checked += 1;
            }
        }
        assert!(checked >= 2 * net.layout().specs().len());
        assert!(
            grad.iter().any(|g| g.abs() > 1e-3),
            "{norm:?}: a zero gradient proves nothing"
        );
    }
}
