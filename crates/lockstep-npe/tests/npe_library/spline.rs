//! The rational-quadratic spline and the flow in f32 (the training precision):
//! invertibility and a normalized density. (The f64 checks live in `jacobian.rs`: burn's
//! ndarray backends share one device, whose float type is fixed by the first use in a
//! process, so each test binary uses one precision.)

use crate::common::{random_params, random_splines, small_network, spline};
use lockstep_npe::spline::SplineParams;
use lockstep_npe::{CpuBackend, DeviceModel, Norm, Placement};

#[test]
fn inverse_of_forward_is_the_identity() {
    let (k, bound) = (8, 3.0);
    let sp = SplineParams::new(k, bound);
    // Moderate spline parameters: in f32 the round trip loses ~1e-7 x the inverse slope, so
    // the 1e-5 bound needs slopes below ~50 (the f64 test in jacobian.rs uses steep splines).
    let (x, w, h, d) = random_splines(2000, k, bound, 0.5, 1);
    let (y, ld) = spline::<CpuBackend>(&x, &w, &h, &d, k, false, &sp);
    let (x2, _) = spline::<CpuBackend>(&y, &w, &h, &d, k, true, &sp);
    let mut moved = 0;
    for i in 0..x.len() {
        assert!(
            (x2[i] - x[i]).abs() <= 1e-5,
            "x {} -> y {} -> {}",
            x[i],
            y[i],
            x2[i]
        );
        if x[i].abs() > bound {
            assert_eq!(
                (y[i], ld[i]),
                (x[i] as f32 as f64, 0.0),
                "tails are the identity"
            );
        } else if (y[i] - x[i]).abs() > 1e-2 {
            moved += 1;
        }
    }
    assert!(
        moved > 1000,
        "the random splines are not the identity ({moved} moved)"
    );
}

#[test]
fn density_of_a_random_2d_flow_integrates_to_one() {
    let net = small_network(2, 2, Norm::None, 2.0);
    let (p, st) = random_params(&net, 0.3, 7);
    // Through the model's non-generic entry (a generic forward named here would compile
    // the network again for this test binary).
    let mut model = DeviceModel::new(net.clone(), 0, &Placement::Cpu).unwrap();
    model.set_parameters(&p).unwrap();
    model.set_state(&st).unwrap();
    let x = [0.5f32, 0.1];
    // Midpoint rule on [-L, L]²; the base is N(0, I) and the flow is the identity beyond the
    // tails (up to the LU map), so the mass outside is negligible.
    // The grid must resolve the narrowest bins (random spline parameters make some bins
    // a few 1e-3 wide): 1000² points of spacing 0.014.
    let (l, g) = (7.0f64, 1000usize);
    let h = 2.0 * l / g as f64;
    let mut total = 0.0f64;
    let mut near_zero_mass = 0.0f64;
    for row in 0..g {
        let t0 = -l + (row as f64 + 0.5) * h;
        let theta: Vec<f32> = (0..g)
            .flat_map(|c| [t0 as f32, (-l + (c as f64 + 0.5) * h) as f32])
            .collect();
        let rows: Vec<f32> = (0..g).flat_map(|_| x).collect();
        let lp = model.log_prob(&theta, &rows, g);
        for (c, v) in lp.iter().enumerate() {
            let m = (*v as f64).exp() * h * h;
            total += m;
            let t1 = -l + (c as f64 + 0.5) * h;
            if t0.abs() < 1.0 && t1.abs() < 1.0 {
                near_zero_mass += m;
            }
        }
    }
    assert!((total - 1.0).abs() <= 1e-2, "∫ q(θ|x) dθ = {total}");
    // Not a standard normal in disguise: the mass near the origin differs from N(0, I)'s 0.466.
    assert!(
        (near_zero_mass - 0.466).abs() > 0.02,
        "mass in [-1,1]² = {near_zero_mass}"
    );
}
