//! Error of one FMM setting against direct summation on a 20,000-particle Plummer sphere,
//! with the largest error per radial bin (log2 radius).
//!
//! `cargo run --release -p lockstep-nbody --example diag -- P THETA`
use lockstep_nbody::accuracy::compare;
use lockstep_nbody::{direct, Fmm, FmmParams, InitialConditions, SourceSet};
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().collect();
    let order: usize = a[1].parse()?;
    let theta: f64 = a[2].parse()?;
    let ic = InitialConditions::Plummer {
        n: 20000,
        total_mass: 1.0,
        scale_radius: 1.0,
        max_radius: 30.0,
        seed: 1,
    };
    let p = ic.generate(1.0, 0, 1, 1.0)?;
    let r = direct(p.valid_pos(), p.valid_mass(), 1.0, 1e-3);
    let fmm = Fmm::new(FmmParams {
        order,
        theta,
        leaf_size: 32,
    })?;
    let (f, _) = fmm.forces(&SourceSet::local(p.valid_pos(), p.valid_mass()), 1.0, 1e-3)?;
    println!("{:?}", compare(&f, &r));
    let mut bins = vec![(0.0f64, 0usize); 8];
    for i in 0..p.num {
        let x = p.pos[i];
        let rad = (x[0] * x[0] + x[1] * x[1] + x[2] * x[2]).sqrt();
        let b = ((rad.log2() + 4.0).max(0.0) as usize).min(7);
        let d: f64 = (0..3)
            .map(|c| (f.acc[i][c] - r.acc[i][c]).powi(2))
            .sum::<f64>()
            .sqrt();
        let rn: f64 = (0..3).map(|c| r.acc[i][c].powi(2)).sum::<f64>().sqrt();
        bins[b].0 = bins[b].0.max(d / rn);
        bins[b].1 += 1;
    }
    println!("{bins:?}");
    Ok(())
}
