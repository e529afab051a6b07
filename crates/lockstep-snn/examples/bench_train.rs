//! Seconds per optimizer step and peak memory of BPTT on the 300-cell all-to-all GLIF3
//! network (batch 16, seq_len 500, dt 1 ms), with and without segmented recompute
//! (the library side of `lockstep bench train`).
//!
//! `cargo run --release -p lockstep-snn --example bench_train -- [BATCH] [SEQ_LEN] [REPEATS]`

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let mut o = lockstep_snn::train::TrainBenchOptions::default();
    if let Some(b) = args.next() {
        o.batch = b.parse()?;
    }
    if let Some(t) = args.next() {
        o.seq_len = t.parse()?;
    }
    if let Some(r) = args.next() {
        o.repeats = r.parse()?;
    }
    let r = lockstep_snn::train::bench_train(&o)?;
    println!("{}", serde_json::to_string_pretty(&r)?);
    Ok(())
}
