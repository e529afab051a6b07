//! Conservation laws of the integrator with FMM forces (issue 8 acceptance): momentum to
//! 1e-6 relative per step, |dE/E| < 1e-3 over 1,000 Plummer-sphere steps.

use lockstep_nbody::{
    simulate, Diagnostics, ForceSettings, Gravity, InitialConditions, Integrator, Method,
    NbodySimulateOptions,
};

fn plummer(n: u64, seed: u64) -> lockstep_nbody::Particles {
    // N-body units: G = M = a = 1; the crossing time is about 1.
    InitialConditions::Plummer {
        n,
        total_mass: 1.0,
        scale_radius: 1.0,
        max_radius: 30.0,
        seed,
    }
    .generate(1.0, 0, 1, 1.0)
    .unwrap()
}

fn run(
    p: &mut lockstep_nbody::Particles,
    steps: usize,
    dt: f64,
    integrator: Integrator,
    outputs: Vec<usize>,
    settings: ForceSettings,
) -> Vec<Diagnostics> {
    let ts: Vec<f64> = (0..=steps).map(|k| k as f64 * dt).collect();
    let mut g = Gravity::new(settings, 1.0).unwrap();
    simulate(
        p,
        &ts,
        &mut g,
        &NbodySimulateOptions {
            integrator,
            outputs,
            keep_on_device: true,
        },
        |_, _, _| Ok(()),
        |_| {},
    )
    .unwrap()
}

fn fmm(softening: f64) -> ForceSettings {
    ForceSettings {
        softening,
        ..Default::default()
    }
}

#[test]
fn momentum_is_conserved_per_step_with_fmm() {
    let mut p = plummer(5_000, 3);
    let d = run(
        &mut p,
        5,
        0.01,
        Integrator::Dkd,
        (0..=5).collect(),
        fmm(0.01),
    );
    for w in d.windows(2) {
        let dp = (0..3)
            .map(|c| (w[1].momentum[c] - w[0].momentum[c]).powi(2))
            .sum::<f64>()
            .sqrt();
        let rel = dp / w[0].momentum_scale;
        println!("t = {}: |dP| / sum m|v| = {rel:e}", w[1].time);
        assert!(rel < 1e-6, "momentum change per step {rel:e}");
    }
}

#[test]
fn plummer_energy_conserved_over_1000_steps() {
    let mut p = plummer(1_000, 4);
    let d = run(
        &mut p,
        1000,
        0.005,
        Integrator::Dkd,
        vec![0, 250, 500, 750, 1000],
        fmm(0.05),
    );
    let e0 = d[0].energy();
    // Virial equilibrium at the start: 2K + W ~ 0.
    assert!(
        (2.0 * d[0].kinetic / -d[0].potential - 1.0).abs() < 0.1,
        "{:?}",
        d[0]
    );
    for x in &d {
        let rel = (x.energy() / e0 - 1.0).abs();
        println!("t = {}: dE/E = {rel:e}", x.time);
        assert!(rel < 1e-3, "t = {}: |dE/E| = {rel:e}", x.time);
    }
    // Particles moved: the run is not trivial.
    assert!((d[4].kinetic - d[0].kinetic).abs() > 0.0);
}

#[test]
fn kdk_and_dkd_agree_and_direct_matches_fmm_trajectory() {
    let p0 = plummer(1_000, 6);
    let mut a = p0.clone();
    let mut b = p0.clone();
    let mut c = p0.clone();
    let da = run(&mut a, 20, 0.01, Integrator::Dkd, vec![0, 20], fmm(0.05));
    let db = run(&mut b, 20, 0.01, Integrator::Kdk, vec![0, 20], fmm(0.05));
    let direct = ForceSettings {
        method: Method::Direct,
        softening: 0.05,
        ..Default::default()
    };
    let dc = run(&mut c, 20, 0.01, Integrator::Dkd, vec![0, 20], direct);
    let maxdiff = |x: &lockstep_nbody::Particles, y: &lockstep_nbody::Particles| {
        (0..x.num)
            .flat_map(|i| (0..3).map(move |k| (i, k)))
            .map(|(i, k)| (x.pos[i][k] - y.pos[i][k]).abs())
            .fold(0.0, f64::max)
    };
    // Both second order: trajectories differ by O(dt^2), far less than the motion itself.
    let moved = maxdiff(&a, &p0);
    assert!(moved > 1e-3);
    assert!(
        maxdiff(&a, &b) < 1e-2 * moved,
        "{} vs {}",
        maxdiff(&a, &b),
        moved
    );
    assert!(
        maxdiff(&a, &c) < 1e-3 * moved,
        "{} vs {}",
        maxdiff(&a, &c),
        moved
    );
    for d in [&da, &db, &dc] {
        assert!((d[1].energy() / d[0].energy() - 1.0).abs() < 1e-4);
    }
}

#[test]
fn bad_times_and_outputs_are_errors() {
    let mut p = plummer(100, 1);
    let mut g = Gravity::new(fmm(0.1), 1.0).unwrap();
    let o = NbodySimulateOptions {
        integrator: Integrator::Dkd,
        outputs: vec![0],
        keep_on_device: true,
    };
    let e = simulate(
        &mut p,
        &[0.0, 1.0, 0.5],
        &mut g,
        &o,
        |_, _, _| Ok(()),
        |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("increasing"), "{e}");
    let o = NbodySimulateOptions {
        integrator: Integrator::Dkd,
        outputs: vec![5],
        keep_on_device: true,
    };
    let e = simulate(&mut p, &[0.0, 1.0], &mut g, &o, |_, _, _| Ok(()), |_| {})
        .unwrap_err()
        .to_string();
    assert!(e.contains("outputs"), "{e}");
    assert!(Gravity::new(
        ForceSettings {
            softening: -1.0,
            ..Default::default()
        },
        1.0
    )
    .is_err());
}
