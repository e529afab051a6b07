//! Prints the FMM accuracy table of the README: 99th percentile relative acceleration error
//! against direct summation for p = 1..6 and theta in {0.4, 0.6, 0.8}, on a Plummer sphere
//! and on Gaussian clumps (N = 20,000 unless given as the first argument).
//!
//! `cargo run --release -p lockstep-nbody --example accuracy_table [N]`

use lockstep_nbody::accuracy::compare;
use lockstep_nbody::{direct, Fmm, FmmParams, InitialConditions, SourceSet};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let n: u64 = std::env::args()
        .nth(1)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(20_000);
    let models = [
        (
            "plummer",
            InitialConditions::Plummer {
                n,
                total_mass: 1.0,
                scale_radius: 1.0,
                max_radius: 30.0,
                seed: 1,
            },
        ),
        (
            "clumps",
            InitialConditions::Clumps {
                n,
                clumps: 10,
                total_mass: 1.0,
                box_size: 10.0,
                clump_radius: 0.2,
                velocity_dispersion: 0.0,
                seed: 2,
            },
        ),
    ];
    let eps = 1e-3;
    for (name, ic) in models {
        let p = ic.generate(1.0, 0, 1, 1.0)?;
        let reference = direct(p.valid_pos(), p.valid_mass(), 1.0, eps);
        println!("\n{name}, N = {n}, eps = {eps}: 99th percentile |a - a_direct|/|a_direct| (median in parentheses), time per evaluation");
        println!("| p | theta = 0.4 | theta = 0.6 | theta = 0.8 |");
        println!("|---|---|---|---|");
        for order in 1..=6 {
            let mut row = format!("| {order} |");
            for theta in [0.4, 0.6, 0.8] {
                let fmm = Fmm::new(FmmParams {
                    order,
                    theta,
                    leaf_size: 32,
                })?;
                let t0 = std::time::Instant::now();
                let (f, _) =
                    fmm.forces(&SourceSet::local(p.valid_pos(), p.valid_mass()), 1.0, eps)?;
                let dt = t0.elapsed().as_secs_f64();
                let acc = compare(&f, &reference);
                row += &format!(
                    " {:.2e} ({:.1e}) {:.0} ms |",
                    acc.acc.p99,
                    acc.acc.p50,
                    dt * 1e3
                );
            }
            println!("{row}");
        }
    }
    Ok(())
}
