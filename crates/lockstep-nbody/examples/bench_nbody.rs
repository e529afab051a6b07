//! Runs the `lockstep bench nbody` benchmark (what the CLI wires up).
//!
//! `cargo run --release -p lockstep-nbody --example bench_nbody [N_fmm,... [N_direct,...]]`

use lockstep_nbody::{bench_nbody, BenchOptions};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let list = |s: &String| -> Result<Vec<usize>, std::num::ParseIntError> {
        s.split(',')
            .filter(|x| !x.is_empty())
            .map(|x| x.parse())
            .collect()
    };
    let mut o = BenchOptions::default();
    if let Some(s) = args.get(1) {
        o.fmm_sizes = list(s)?;
    }
    if let Some(s) = args.get(2) {
        o.direct_sizes = list(s)?;
    }
    bench_nbody(&o)?;
    Ok(())
}
