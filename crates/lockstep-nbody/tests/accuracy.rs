//! FMM against direct summation (issue 8 acceptance: 99th percentile relative acceleration
//! error <= 1e-3 at the defaults on 20,000 particles; error falls as p rises), and the
//! imported-source paths used by sharded runs.

use lockstep_nbody::accuracy::compare;
use lockstep_nbody::fmm::RemoteCell;
use lockstep_nbody::{direct, direct_on, Fmm, FmmParams, InitialConditions, NearField, SourceSet};

const EPS: f64 = 1e-3;

fn plummer(n: u64) -> lockstep_nbody::Particles {
    InitialConditions::Plummer {
        n,
        total_mass: 1.0,
        scale_radius: 1.0,
        max_radius: 30.0,
        seed: 11,
    }
    .generate(1.0, 0, 1, 1.0)
    .unwrap()
}

fn clumps(n: u64) -> lockstep_nbody::Particles {
    InitialConditions::Clumps {
        n,
        clumps: 12,
        total_mass: 1.0,
        box_size: 10.0,
        clump_radius: 0.15,
        velocity_dispersion: 0.0,
        seed: 12,
    }
    .generate(1.0, 0, 1, 1.0)
    .unwrap()
}

fn check_defaults(p: &lockstep_nbody::Particles, name: &str) {
    let reference = direct(p.valid_pos(), p.valid_mass(), 1.0, EPS);
    let fmm = Fmm::new(FmmParams::default()).unwrap();
    let (f, stats) = fmm
        .forces(&SourceSet::local(p.valid_pos(), p.valid_mass()), 1.0, EPS)
        .unwrap();
    let acc = compare(&f, &reference);
    println!("{name}: {acc:?}\n{stats:?}");
    assert!(
        stats.m2l > 0 && stats.p2p_pairs > 0,
        "both far and near field used: {stats:?}"
    );
    assert!(
        acc.acc.p99 <= 1e-3,
        "{name}: p99 acceleration error {:e}",
        acc.acc.p99
    );
    assert!(
        acc.pot.p99 <= 1e-4,
        "{name}: p99 potential error {:e}",
        acc.pot.p99
    );
}

#[test]
fn fmm_defaults_match_direct_on_plummer_20k() {
    let d = FmmParams::default();
    assert!(
        d.order >= 4 && d.theta <= 0.6,
        "defaults at least as strict as p=4, theta=0.6"
    );
    check_defaults(&plummer(20_000), "plummer");
}

#[test]
fn fmm_defaults_match_direct_on_clumps_20k() {
    check_defaults(&clumps(20_000), "clumps");
}

#[test]
fn fmm_error_falls_as_order_rises() {
    let p = plummer(20_000);
    let reference = direct(p.valid_pos(), p.valid_mass(), 1.0, EPS);
    let mut p99 = Vec::new();
    let mut p50 = Vec::new();
    for order in 1..=6 {
        let fmm = Fmm::new(FmmParams {
            order,
            theta: 0.6,
            leaf_size: 32,
            ..FmmParams::default()
        })
        .unwrap();
        let (f, _) = fmm
            .forces(&SourceSet::local(p.valid_pos(), p.valid_mass()), 1.0, EPS)
            .unwrap();
        let a = compare(&f, &reference);
        p99.push(a.acc.p99);
        p50.push(a.acc.p50);
    }
    println!("p99 by order: {p99:?}\nmedian by order: {p50:?}");
    for k in 1..p99.len() {
        assert!(
            p99[k] < p99[k - 1] && p50[k] < p50[k - 1],
            "p99 {p99:?} p50 {p50:?}"
        );
    }
    assert!(p99[5] < 0.05 * p99[0], "p=6 vs p=1: {p99:?}");
    // Smaller theta also reduces the error.
    let fmm = Fmm::new(FmmParams {
        order: 4,
        theta: 0.4,
        leaf_size: 32,
        ..FmmParams::default()
    })
    .unwrap();
    let (f, _) = fmm
        .forces(&SourceSet::local(p.valid_pos(), p.valid_mass()), 1.0, EPS)
        .unwrap();
    assert!(compare(&f, &reference).acc.p99 < p99[3]);
}

#[test]
fn imported_particles_act_as_sources_only() {
    // Split a clumpy set into "local" and "remote" halves: forces on the locals from
    // locals + imported particles equal the forces of the whole set.
    let p = clumps(6_000);
    let (pos, mass) = (p.valid_pos(), p.valid_mass());
    let reference = direct_on(&pos[..3000], Some(0), pos, mass, 1.0, EPS);
    let fmm = Fmm::new(FmmParams::default()).unwrap();
    let src = SourceSet {
        pos: &pos[..3000],
        mass: &mass[..3000],
        remote_pos: &pos[3000..],
        remote_mass: &mass[3000..],
        remote_cells: &[],
    };
    let (f, _) = fmm.forces(&src, 1.0, EPS).unwrap();
    assert_eq!(f.acc.len(), 3000);
    let a = compare(&f, &reference);
    assert!(a.acc.p99 <= 1e-3, "{a:?}");
    // Without the imported half the forces are wrong: the test can fail.
    let (alone, _) = fmm
        .forces(&SourceSet::local(&pos[..3000], &mass[..3000]), 1.0, EPS)
        .unwrap();
    assert!(compare(&alone, &reference).acc.p50 > 1e-2);
}

#[test]
fn imported_multipoles_reproduce_a_distant_cluster() {
    // A distant Plummer cluster sent as the multipoles of its tree's top nodes.
    let local = plummer(3_000);
    let far = InitialConditions::Plummer {
        n: 3_000,
        total_mass: 2.0,
        scale_radius: 0.5,
        max_radius: 5.0,
        seed: 5,
    }
    .generate(1.0, 0, 1, 1.0)
    .unwrap();
    let shift = [60.0, -20.0, 10.0];
    let far_pos: Vec<[f64; 3]> = far
        .valid_pos()
        .iter()
        .map(|x| [x[0] + shift[0], x[1] + shift[1], x[2] + shift[2]])
        .collect();
    let fmm = Fmm::new(FmmParams::default()).unwrap();
    let far_tree = fmm.build_tree(&SourceSet::local(&far_pos, far.valid_mass()));
    let nt = fmm.nterms();
    // Level-2 nodes and shallower leaves cover the cluster exactly once.
    let cells: Vec<RemoteCell> = far_tree
        .nodes
        .iter()
        .enumerate()
        .filter(|(_, nd)| nd.level == 2 || (nd.level < 2 && nd.is_leaf()))
        .map(|(i, nd)| RemoteCell {
            center: nd.center,
            radius: nd.radius,
            multipole: far_tree.multipole(i, nt).to_vec(),
        })
        .collect();
    assert!(cells.len() > 8);
    let mut all_pos = local.valid_pos().to_vec();
    all_pos.extend_from_slice(&far_pos);
    let mut all_mass = local.valid_mass().to_vec();
    all_mass.extend_from_slice(far.valid_mass());
    let reference = direct_on(local.valid_pos(), Some(0), &all_pos, &all_mass, 1.0, EPS);
    let src = SourceSet {
        remote_cells: &cells,
        ..SourceSet::local(local.valid_pos(), local.valid_mass())
    };
    let (f, stats) = fmm.forces(&src, 1.0, EPS).unwrap();
    assert_eq!(stats.forced_m2l, 0, "cells are far enough: {stats:?}");
    let a = compare(&f, &reference);
    assert!(a.acc.p99 <= 1e-3, "{a:?}");
    // A wrong order is a clear error.
    let bad = vec![RemoteCell {
        center: [0.0; 3],
        radius: 0.0,
        multipole: vec![1.0; 3],
    }];
    let e = fmm
        .forces(
            &SourceSet {
                remote_cells: &bad,
                ..src
            },
            1.0,
            EPS,
        )
        .unwrap_err()
        .to_string();
    assert!(e.contains("coefficients"), "{e}");
}

#[test]
fn near_field_f32_matches_f64_on_plummer_and_clumps() {
    for (p, name) in [(plummer(20_000), "plummer"), (clumps(20_000), "clumps")] {
        let src = SourceSet::local(p.valid_pos(), p.valid_mass());
        let run = |near_field| {
            let params = FmmParams {
                near_field,
                ..FmmParams::default()
            };
            Fmm::new(params).unwrap().forces(&src, 1.0, EPS).unwrap().0
        };
        let (single, double) = (run(NearField::F32), run(NearField::F64));
        let diff = compare(&single, &double);
        println!("{name}: f32 near field against f64: {diff:?}");
        // f32 rounding (about 6e-8 per operation) and the f32 `1 / sqrt` (within 5e-7 of
        // either sign, so 1.5e-6 on `1 / r^3`) over thousands of pairs summed in f64.
        assert!(
            diff.acc.p99 < 2e-6 && diff.acc.max < 3e-5,
            "{name}: {diff:?}"
        );
        assert!(
            diff.pot.p99 < 2e-7 && diff.pot.max < 1e-6,
            "{name}: {diff:?}"
        );
        // Far below the far-field truncation error against direct summation.
        let reference = direct(p.valid_pos(), p.valid_mass(), 1.0, EPS);
        let (e32, e64) = (compare(&single, &reference), compare(&double, &reference));
        assert!(
            (e32.acc.p99 - e64.acc.p99).abs() < 0.01 * e64.acc.p99,
            "{name}: p99 error {:e} (f32) against {:e} (f64)",
            e32.acc.p99,
            e64.acc.p99
        );
    }
}

#[test]
fn degenerate_inputs() {
    // Coincident particles (keys exhausted), a single particle, and no particles.
    let pos = vec![[1.0, 2.0, 3.0]; 100];
    let mass = vec![1.0; 100];
    let r = direct(&pos, &mass, 1.0, 0.1);
    for (near_field, tol) in [(NearField::F64, 1e-12), (NearField::F32, 1e-6)] {
        let fmm = Fmm::new(FmmParams {
            near_field,
            ..FmmParams::default()
        })
        .unwrap();
        let (f, _) = fmm
            .forces(&SourceSet::local(&pos, &mass), 1.0, 0.1)
            .unwrap();
        for i in 0..100 {
            assert!(
                (f.pot[i] - r.pot[i]).abs() < tol * r.pot[i].abs(),
                "{near_field:?}"
            );
            assert!(f.acc[i].iter().all(|a| a.abs() < 1e-12), "{near_field:?}");
        }
    }
    let fmm = Fmm::new(FmmParams::default()).unwrap();
    let (f, _) = fmm
        .forces(&SourceSet::local(&pos[..1], &mass[..1]), 1.0, 0.1)
        .unwrap();
    assert_eq!(f.pot, vec![0.0]);
    let (f, _) = fmm.forces(&SourceSet::local(&[], &[]), 1.0, 0.1).unwrap();
    assert!(f.acc.is_empty());
    let bad = [[f64::NAN, 0.0, 0.0]];
    assert!(fmm
        .forces(&SourceSet::local(&bad, &[1.0]), 1.0, 0.1)
        .is_err());
    for (o, t, l) in [
        (0, 0.6, 32),
        (7, 0.6, 32),
        (4, 1.0, 32),
        (4, 0.0, 32),
        (4, 0.6, 0),
    ] {
        let e = Fmm::new(FmmParams {
            order: o,
            theta: t,
            leaf_size: l,
            ..FmmParams::default()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("forces."), "{e}");
    }
}
