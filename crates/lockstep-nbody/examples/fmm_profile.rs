//! Work counts and time of one FMM evaluation on a Plummer sphere.
//!
//! `cargo run --release -p lockstep-nbody --example fmm_profile [N] [p] [theta] [leaf_size]`

use lockstep_nbody::{Fmm, FmmParams, InitialConditions, SourceSet};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().collect();
    let n: u64 = a.get(1).map(|s| s.parse()).transpose()?.unwrap_or(20_000);
    let order: usize = a.get(2).map(|s| s.parse()).transpose()?.unwrap_or(4);
    let theta: f64 = a.get(3).map(|s| s.parse()).transpose()?.unwrap_or(0.6);
    let leaf_size: usize = a.get(4).map(|s| s.parse()).transpose()?.unwrap_or(32);
    let ic = InitialConditions::Plummer {
        n,
        total_mass: 1.0,
        scale_radius: 1.0,
        max_radius: 30.0,
        seed: 1,
    };
    let p = ic.generate(1.0, 0, 1, 1.0)?;
    let fmm = Fmm::new(FmmParams {
        order,
        theta,
        leaf_size,
    })?;
    for _ in 0..2 {
        let t0 = std::time::Instant::now();
        let (_, st) = fmm.forces(&SourceSet::local(p.valid_pos(), p.valid_mass()), 1.0, 1e-3)?;
        println!("{:.1} ms {:?}", t0.elapsed().as_secs_f64() * 1e3, st);
    }
    Ok(())
}
