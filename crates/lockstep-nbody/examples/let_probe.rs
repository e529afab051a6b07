//! Locally essential tree traffic per rank for a Plummer sphere on ThreadComm ranks.
//!
//! `cargo run --release -p lockstep-nbody --example let_probe [RANKS [N]]`
use lockstep_comm::{run_replicas, Communicator};
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
