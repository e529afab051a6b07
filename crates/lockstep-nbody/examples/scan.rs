//! Accuracy and time of the FMM over a grid of parameters (leaf size, order, opening
//! angle) on a 20,000-particle Plummer sphere, against direct summation.
//!
//! `cargo run --release -p lockstep-nbody --example scan [p,.. [theta,.. [leaf,..]]]`
use lockstep_nbody::accuracy::compare;
use lockstep_nbody::{direct, Fmm, FmmParams, InitialConditions, SourceSet};
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().collect();
    let list = |k: usize, d: &str| -> Vec<f64> {
        a.get(k)
            .map(|s| s.as_str())
            .unwrap_or(d)
            .split(',')
            .map(|x| x.parse().unwrap())
            .collect()
    };
    let (orders, thetas, leaves) = (list(1, "4,5,6"), list(2, "0.4,0.5,0.6"), list(3, "16,32"));
    let ic = InitialConditions::Plummer {
        n: 20000,
        total_mass: 1.0,
        scale_radius: 1.0,
        max_radius: 30.0,
        seed: 1,
    };
    let p = ic.generate(1.0, 0, 1, 1.0)?;
    let t0 = std::time::Instant::now();
    let r = direct(p.valid_pos(), p.valid_mass(), 1.0, 1e-3);
    println!("direct: {:.0} ms", t0.elapsed().as_secs_f64() * 1e3);
    for &order in &orders {
        for &theta in &thetas {
            for &leaf in &leaves {
                let fmm = Fmm::new(FmmParams {
                    order: order as usize,
                    theta,
                    leaf_size: leaf as usize,
                })?;
                let mut best = 1e9f64;
                let mut res = None;
                for _ in 0..2 {
                    let c = std::time::Instant::now();
                    let (f, st) =
                        fmm.forces(&SourceSet::local(p.valid_pos(), p.valid_mass()), 1.0, 1e-3)?;
                    best = best.min(c.elapsed().as_secs_f64());
                    res = Some((f, st));
                }
                let (f, st) = res.expect("ran");
                let acc = compare(&f, &r);
                println!(
                    "p {order} theta {theta} leaf {leaf}: {:.0} ms p99 {:.2e} p50 {:.2e} m2l {} m2p {} pairs {} phases {:?}",
                    best * 1e3, acc.acc.p99, acc.acc.p50, st.m2l, st.m2p, st.p2p_pairs, st.seconds
                );
            }
        }
    }
    Ok(())
}
