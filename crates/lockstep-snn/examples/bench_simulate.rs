//! Throughput of the NEST-exact forward pass on `point_450glifs` (dt 0.1 ms, 1000 ms) and
//! its ratio to NEST 3.10's recorded wall time (the library side of `lockstep bench simulate`).
//!
//! `cargo run --release -p lockstep-snn --example bench_simulate -- [SHARED_DIR] [BATCH] [REPEATS]`

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let shared = args
        .next()
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../shared")));
    let batch: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(1);
    let repeats: usize = args.next().map(|s| s.parse()).transpose()?.unwrap_or(5);
    for parallel in [false, true] {
        let r = lockstep_snn::bench_simulate(&lockstep_snn::BenchOptions {
            shared_dir: shared.clone(),
            repeats,
            batch,
            parallel,
        })?;
        println!("parallel={parallel} {}", serde_json::to_string_pretty(&r)?);
    }
    Ok(())
}
