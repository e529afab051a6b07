//! Times one FMM evaluation of a Plummer sphere by phase (tree build, upward pass, traversal,
//! M2L, L2L, L2P, M2P, P2P) and prints the interaction counts and the accuracy on 2,000
//! targets against direct summation.
//!
//! `cargo run --release -p lockstep-nbody --example fmm_phases [N [p [theta [leaf_size]]]]`

use lockstep_nbody::accuracy::compare;
use lockstep_nbody::{direct_on, Fmm, FmmParams, Forces, InitialConditions, SourceSet};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let arg = |k: usize| std::env::args().nth(k);
    let n: u64 = arg(1).map(|s| s.parse()).transpose()?.unwrap_or(1_000_000);
    let d = FmmParams::default();
    let params = FmmParams {
        order: arg(2).map(|s| s.parse()).transpose()?.unwrap_or(d.order),
        theta: arg(3).map(|s| s.parse()).transpose()?.unwrap_or(d.theta),
        leaf_size: arg(4)
            .map(|s| s.parse())
            .transpose()?
            .unwrap_or(d.leaf_size),
    };
    let p = InitialConditions::Plummer {
        n,
        total_mass: 1.0,
        scale_radius: 1.0,
        max_radius: 30.0,
        seed: 2024,
    }
    .generate(1.0, 0, 1, 1.0)?;
    let (pos, mass) = (p.valid_pos(), p.valid_mass());
    let fmm = Fmm::new(params)?;
    let t0 = std::time::Instant::now();
    let (f, st) = fmm.forces(&SourceSet::local(pos, mass), 1.0, 0.0)?;
    let wall = t0.elapsed().as_secs_f64();
    let k = 2000.min(pos.len());
    let reference = direct_on(&pos[..k], Some(0), pos, mass, 1.0, 0.0);
    let sub = Forces {
        acc: f.acc[..k].to_vec(),
        pot: f.pot[..k].to_vec(),
    };
    let a = compare(&sub, &reference);
    let s = st.seconds;
    println!(
        "N {n} p {} theta {} leaf {}: {wall:.3} s, acc p50 {:.2e} p99 {:.2e}",
        params.order, params.theta, params.leaf_size, a.acc.p50, a.acc.p99
    );
    println!(
        "tree {:.3} upward {:.3} traversal {:.3} m2l {:.3} l2l {:.3} l2p {:.3} m2p {:.3} p2p {:.3}",
        s.tree, s.upward, s.traversal, s.m2l, s.l2l, s.l2p, s.m2p, s.p2p
    );
    println!(
        "nodes {} depth {} m2l {} m2p {} p2p blocks {} p2p pairs {:.3e}",
        st.nodes, st.depth, st.m2l, st.m2p, st.p2p_blocks, st.p2p_pairs as f64
    );
    Ok(())
}
