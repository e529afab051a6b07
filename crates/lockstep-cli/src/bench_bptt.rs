//! `lockstep bench bptt`: seconds per optimizer step and memory of BPTT on the 300-cell
//! all-to-all GLIF3 network, with and without segmented recompute (lockstep-snn).

use anyhow::Result;
use lockstep_snn::train::{bench_train, TrainBenchOptions};

/// Options of `lockstep bench bptt`.
#[derive(Debug, clap::Args)]
pub struct BpttArgs {
    /// Cells of the all-to-all GLIF3 network.
    #[arg(long, default_value_t = 300)]
    pub cells: usize,
    /// Samples per step.
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Steps per sample.
    #[arg(long, default_value_t = 500)]
    pub seq_len: usize,
    /// Time step (ms).
    #[arg(long, default_value_t = 1.0)]
    pub dt: f64,
    /// Segmented-BPTT chunk (steps).
    #[arg(long, default_value_t = 25)]
    pub chunk: usize,
    /// Timed steps per configuration.
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
}

/// Runs both configurations and prints the comparison.
pub fn run(args: &BpttArgs) -> Result<()> {
    let r = bench_train(&TrainBenchOptions {
        n_cells: args.cells,
        batch: args.batch,
        seq_len: args.seq_len,
        dt: args.dt,
        chunk: args.chunk,
        repeats: args.repeats.max(1),
        parallel: true,
    })?;
    println!(
        "BPTT, {} all-to-all GLIF3 cells ({} weights), batch {}, seq_len {}, dt {} ms, {} rayon threads",
        r.n_cells,
        r.n_params,
        r.batch,
        r.seq_len,
        r.dt,
        rayon_threads()
    );
    println!(
        "{:>22} {:>12} {:>18} {:>20}",
        "", "s / step", "peak RSS growth", "stored state/sample"
    );
    for (name, run) in [
        ("every step stored", &r.full),
        ("segmented recompute", &r.segmented),
    ] {
        let rss = run
            .peak_rss_bytes
            .map(|b| format!("{:.1} MiB", b as f64 / 1048576.0))
            .unwrap_or_else(|| "n/a".into());
        println!(
            "{:>22} {:>12.3} {:>18} {:>16.1} MiB",
            name,
            run.s_per_step,
            rss,
            run.tape_bytes_per_sample as f64 / 1048576.0
        );
    }
    println!(
        "segmented / stored: time {:.2}, stored state {:.2}{}",
        r.time_ratio,
        r.tape_memory_ratio,
        r.rss_memory_ratio
            .map(|m| format!(", peak RSS growth {m:.2}"))
            .unwrap_or_default()
    );
    Ok(())
}

fn rayon_threads() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}
