//! Locally essential tree traffic per rank for a Plummer sphere on ThreadComm ranks.
//!
//! `cargo run --release -p lockstep-nbody --example let_probe [RANKS [N]]`
#![allow(clippy::needless_range_loop)]
use lockstep_comm::{run_replicas, CommExt, Communicator};
use lockstep_nbody::shard::{redistribute, sharded_forces};
use lockstep_nbody::{Fmm, FmmParams, InitialConditions, NbodyError};
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().collect();
    let r: usize = a.get(1).map(|s| s.parse()).transpose()?.unwrap_or(2);
    let n: u64 = a.get(2).map(|s| s.parse()).transpose()?.unwrap_or(100_000);
    let ic = InitialConditions::Plummer {
        n,
        total_mass: 1.0,
        scale_radius: 1.0,
        max_radius: 30.0,
        seed: 2024,
    };
    let fmm = Fmm::new(FmmParams::default())?;
    let out = run_replicas(r, |comm| -> Result<String, NbodyError> {
        let mut p = ic.generate(1.0, comm.rank(), r, 1.5)?;
        redistribute(&comm, &mut p)?;
        let (_, st) = sharded_forces(&comm, &p, &fmm, 1.0, 1e-3)?;
        // Distance of a sample of this rank's particles to the nearest particle elsewhere.
        let all = comm.all_gather_vec(&[p.num as u64])?;
        let maxn = *all.iter().max().unwrap() as usize;
        let mut mine = vec![f64::NAN; 3 * maxn];
        for i in 0..p.num {
            mine[3 * i..3 * i + 3].copy_from_slice(&p.pos[i]);
        }
        let every = comm.all_gather_vec(&mine)?;
        let mut near = [0usize; 4];
        let step = (p.num / 500).max(1);
        for i in (0..p.num).step_by(step) {
            let mut dmin = f64::INFINITY;
            for r in 0..comm.size() {
                if r == comm.rank() {
                    continue;
                }
                for k in 0..all[r] as usize {
                    let o = 3 * (r * maxn + k);
                    let d = ((every[o] - p.pos[i][0]).powi(2)
                        + (every[o + 1] - p.pos[i][1]).powi(2)
                        + (every[o + 2] - p.pos[i][2]).powi(2))
                    .sqrt();
                    dmin = dmin.min(d);
                }
            }
            let b = if dmin < 0.1 {
                0
            } else if dmin < 0.3 {
                1
            } else if dmin < 1.0 {
                2
            } else {
                3
            };
            near[b] += 1;
        }
        println!(
            "rank {}: sampled particles by distance to other ranks (<0.1, <0.3, <1, >=1): {near:?}",
            comm.rank()
        );
        Ok(format!(
            "rank {}: {} particles, sent {} cells and {} particles ({} bytes), {:?}",
            comm.rank(),
            p.num,
            st.cells_sent,
            st.particles_sent,
            st.bytes_sent,
            st.fmm
        ))
    })?;
    for line in out {
        println!("{line}");
    }
    Ok(())
}
