//! `lockstep simulate CONFIG` through the library: runs a BMTK-style simulation config and
//! prints the summary.
//!
//! `cargo run --release -p lockstep-snn --example simulate -- CONFIG`

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let config = std::env::args().nth(1).ok_or("usage: simulate CONFIG")?;
    let s = lockstep_snn::simulate_config(
        std::path::Path::new(&config),
        &lockstep_snn::SimulateOptions::default(),
    )?;
    println!("{s:#?}");
    Ok(())
}
