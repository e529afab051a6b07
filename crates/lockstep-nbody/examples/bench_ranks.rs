//! Runs the sharded benchmark (`lockstep bench nbody --ranks 1,2`).
//!
//! `cargo run --release -p lockstep-nbody --example bench_ranks [RANKS [N]]`, e.g. `1,2 1000000`.

use lockstep_nbody::{bench_nbody_ranks, FmmParams};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let ranks: Vec<usize> = args
        .get(1)
        .map(|s| s.as_str())
        .unwrap_or("1,2")
        .split(',')
        .map(|x| x.parse())
        .collect::<Result<_, _>>()?;
    let n: usize = args
        .get(2)
        .map(|s| s.parse())
        .transpose()?
        .unwrap_or(1_000_000);
    bench_nbody_ranks(&ranks, n, FmmParams::default(), 2)?;
    Ok(())
}
