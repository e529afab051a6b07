//! Sharded forces (issue 9, first part): Morton sample-sort redistribution and the locally
//! essential tree exchange on 2, 3 and 4 ThreadComm ranks agree with direct summation and
//! with the one-rank FMM, on uniform and strongly clustered particles that all start on
//! rank 0.

use lockstep_comm::{run_replicas, Communicator};
use lockstep_nbody::accuracy::compare;
use lockstep_nbody::shard::{redistribute, sharded_forces, sharded_forces_in_place};
use lockstep_nbody::{
    direct, Fmm, FmmParams, Forces, InitialConditions, NbodyError, Particles, SourceSet,
};

const EPS: f64 = 1e-3;

fn models(n: u64) -> Vec<(&'static str, InitialConditions)> {
    vec![
        (
            "uniform",
            InitialConditions::UniformCube {
                n,
                total_mass: 1.0,
                box_size: 4.0,
                velocity_dispersion: 0.0,
                seed: 21,
            },
        ),
        (
            "clumps",
            InitialConditions::Clumps {
                n,
                clumps: 6,
                total_mass: 1.0,
                box_size: 10.0,
                clump_radius: 0.1,
                velocity_dispersion: 0.0,
                seed: 22,
            },
        ),
    ]
}

/// Rank 0 holds every particle at the start; the others are empty but padded.
fn start_on_rank0(ic: &InitialConditions, rank: usize, size: usize) -> Particles {
    let all = ic.generate(1.0, 0, 1, 1.0).unwrap();
    let n = all.num;
    let cap = (n / size) * 5 / 4 + 8;
    if rank == 0 {
        let mut p = Particles::with_capacity(n.max(cap), n as u64);
        for i in 0..n {
            p.push(all.pos[i], all.vel[i], all.mass[i], all.id[i], 0)
                .unwrap();
        }
        p
    } else {
        Particles::with_capacity(cap, n as u64)
    }
}

/// Forces ordered by particle id.
fn by_id(parts: Vec<Vec<(u64, [f64; 3], f64)>>, n: usize) -> Forces {
    let mut f = Forces::zeros(n);
    let mut seen = vec![false; n];
    for (id, a, p) in parts.into_iter().flatten() {
        assert!(!seen[id as usize], "particle {id} on two ranks");
        seen[id as usize] = true;
        f.acc[id as usize] = a;
        f.pot[id as usize] = p;
    }
    assert!(
        seen.iter().all(|&s| s),
        "every particle lives on exactly one rank"
    );
    f
}

#[test]
fn sharded_forces_match_direct_and_one_rank_on_2_3_4_ranks() {
    let n = 10_000;
    let fmm = Fmm::new(FmmParams::default()).unwrap();
    // With softening and without (the harmonic M2L/M2P, imported multipoles included).
    for (name, ic, eps) in models(n as u64)
        .into_iter()
        .flat_map(|(name, ic)| [EPS, 0.0].map(|eps| (name, ic.clone(), eps)))
    {
        let all = ic.generate(1.0, 0, 1, 1.0).unwrap();
        let reference = direct(all.valid_pos(), all.valid_mass(), 1.0, eps);
        let (one, _) = fmm
            .forces(
                &SourceSet::local(all.valid_pos(), all.valid_mass()),
                1.0,
                eps,
            )
            .unwrap();
        let one_acc = compare(&one, &reference);
        for size in [2usize, 3, 4] {
            let parts = run_replicas(size, |comm| -> Result<_, NbodyError> {
                let mut p = start_on_rank0(&ic, comm.rank(), size);
                let st = redistribute(&comm, &mut p)?;
                assert!(st.imbalance <= 1.0 + size as f64 / n as f64, "{st:?}");
                let (f, fs) = sharded_forces(&comm, &p, &fmm, 1.0, eps)?;
                assert!(fs.cells_sent > 0 || fs.particles_sent > 0);
                Ok((0..p.num)
                    .map(|i| (p.id[i], f.acc[i], f.pot[i]))
                    .collect::<Vec<_>>())
            })
            .unwrap();
            let f = by_id(parts, n);
            let vs_direct = compare(&f, &reference);
            let vs_one = compare(&f, &one);
            let name = format!("{name}, eps {eps}");
            println!("{name} on {size} ranks: vs direct {:?}\n  vs one rank {:?}\n  one rank vs direct {:?}", vs_direct.acc, vs_one.acc, one_acc.acc);
            assert!(
                vs_direct.acc.p99 <= 1e-3,
                "{name}, {size} ranks: {vs_direct:?}"
            );
            assert!(
                vs_direct.pot.p99 <= 1e-4,
                "{name}, {size} ranks: {vs_direct:?}"
            );
            assert!(vs_one.acc.p99 <= 1e-3, "{name}, {size} ranks: {vs_one:?}");
        }
    }
}

#[test]
fn redistribution_balances_keeps_every_particle_and_reports_overflow() {
    let ic = InitialConditions::Clumps {
        n: 5_001,
        clumps: 3,
        total_mass: 1.0,
        box_size: 5.0,
        clump_radius: 0.2,
        velocity_dispersion: 1.0,
        seed: 4,
    };
    let all = ic.generate(1.0, 0, 1, 1.0).unwrap();
    let parts = run_replicas(3, |comm| -> Result<_, NbodyError> {
        let mut p = start_on_rank0(&ic, comm.rank(), 3);
        redistribute(&comm, &mut p)?;
        Ok((
            p.num,
            (0..p.num)
                .map(|i| (p.id[i], p.pos[i], p.vel[i], p.mass[i]))
                .collect::<Vec<_>>(),
        ))
    })
    .unwrap();
    let counts: Vec<usize> = parts.iter().map(|p| p.0).collect();
    assert_eq!(counts.iter().sum::<usize>(), 5_001);
    assert!(counts.iter().all(|&c| c == 1667), "{counts:?}");
    for (id, x, v, m) in parts.into_iter().flat_map(|p| p.1) {
        let i = id as usize;
        assert_eq!((x, v, m), (all.pos[i], all.vel[i], all.mass[i]));
    }
    // Too little padding: every rank reports the overflow, naming the option.
    let err = run_replicas(2, |comm| -> Result<(), NbodyError> {
        let mut p = if comm.rank() == 0 {
            ic.generate(1.0, 0, 1, 1.0).unwrap()
        } else {
            Particles::with_capacity(100, 5_001)
        };
        redistribute(&comm, &mut p)?;
        Ok(())
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("capacity_factor"), "{err}");
}

#[test]
fn forces_return_to_the_original_rank_and_index() {
    let n = 6_000;
    let ic = InitialConditions::Clumps {
        n,
        clumps: 5,
        total_mass: 1.0,
        box_size: 6.0,
        clump_radius: 0.2,
        velocity_dispersion: 0.0,
        seed: 8,
    };
    let all = ic.generate(1.0, 0, 1, 1.0).unwrap();
    let reference = direct(all.valid_pos(), all.valid_mass(), 1.0, EPS);
    let fmm = Fmm::new(FmmParams::default()).unwrap();
    let parts = run_replicas(3, |comm| -> Result<_, NbodyError> {
        // Each rank keeps its generated particles in generation order.
        let p = ic.generate(1.0, comm.rank(), 3, 1.0)?;
        let (f, _) = sharded_forces_in_place(&comm, &p, &fmm, 1.0, EPS)?;
        assert_eq!(f.acc.len(), p.num);
        Ok((0..p.num)
            .map(|i| (p.id[i], f.acc[i], f.pot[i]))
            .collect::<Vec<_>>())
    })
    .unwrap();
    // Rank r holds ids [r n/3, (r+1) n/3) in order, and their forces at the same index.
    for (r, part) in parts.iter().enumerate() {
        let start = (n as usize * r) / 3;
        assert!(part
            .iter()
            .enumerate()
            .all(|(i, x)| x.0 == (start + i) as u64));
    }
    let f = by_id(parts, n as usize);
    let a = compare(&f, &reference);
    assert!(a.acc.p99 <= 1e-3, "{a:?}");
}
