//! `lockstep bench bptt`: seconds per optimizer step and memory of BPTT on the 300-cell
//! all-to-all GLIF3 network, with and without segmented recompute (lockstep-snn).
//!
//! The measurement runs here, not in the library: peak memory comes from
//! [`lockstep_core::memory`].

use anyhow::Result;
use lockstep_core::memory;
use lockstep_snn::{
    all_to_all_glif3, BpttOptions, InputSpec, Loss, PoissonSpec, RateUnits, SnnModel,
};

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
    let r = bench_bptt(&BpttBenchOptions {
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

/// Options of [`bench_bptt`].
#[derive(Debug, Clone, PartialEq)]
pub struct BpttBenchOptions {
    /// Cells of the all-to-all GLIF3 network ([`lockstep_snn::all_to_all_glif3`]).
    pub n_cells: usize,
    /// Samples per step.
    pub batch: usize,
    /// Steps per sample.
    pub seq_len: usize,
    /// Time step (ms).
    pub dt: f64,
    /// Segmented-BPTT chunk size for the segmented run (steps).
    pub chunk: usize,
    /// Timed steps per configuration (after one warm-up step).
    pub repeats: usize,
    /// Samples on rayon.
    pub parallel: bool,
}

impl Default for BpttBenchOptions {
    fn default() -> Self {
        BpttBenchOptions {
            n_cells: 300,
            batch: 16,
            seq_len: 500,
            dt: 1.0,
            chunk: 25,
            repeats: 3,
            parallel: true,
        }
    }
}

/// One configuration of [`bench_bptt`].
#[derive(Debug, Clone, PartialEq)]
pub struct BpttBenchRun {
    /// Segmented chunk size (`None`: every step stored).
    pub chunk: Option<usize>,
    /// Mean seconds per optimizer step (forward + backward + sign constraint; the O(params)
    /// optimizer update itself is excluded).
    pub s_per_step: f64,
    /// Peak resident memory growth during the step (bytes), from `/proc/self/status`
    /// `VmHWM` after resetting it; `None` where the kernel does not allow the reset.
    pub peak_rss_bytes: Option<u64>,
    /// Stored forward state per sample (bytes, analytic).
    pub tape_bytes_per_sample: usize,
    /// Stored forward state alive at once (bytes, analytic): per sample times the samples
    /// that run concurrently (rayon threads, at most the batch).
    pub tape_bytes_concurrent: usize,
    /// Loss of the last step (both configurations must agree exactly).
    pub loss: f64,
}

/// Report of [`bench_bptt`].
#[derive(Debug, Clone, PartialEq)]
pub struct BpttBenchReport {
    /// Cells.
    pub n_cells: usize,
    /// Recurrent edges (trainable parameters).
    pub n_params: usize,
    /// Samples per step.
    pub batch: usize,
    /// Steps per sample.
    pub seq_len: usize,
    /// Time step (ms).
    pub dt: f64,
    /// Without segmented recompute.
    pub full: BpttBenchRun,
    /// With segmented recompute.
    pub segmented: BpttBenchRun,
    /// `segmented / full` of the stored forward state.
    pub tape_memory_ratio: f64,
    /// `segmented / full` of the measured peak RSS growth, when measurable.
    pub rss_memory_ratio: Option<f64>,
    /// `segmented / full` of the step time.
    pub time_ratio: f64,
}

/// `lockstep bench bptt`: seconds per optimizer step and peak memory of BPTT on the
/// all-to-all GLIF3 network toward a 10 Hz target, with and without segmented recompute.
pub fn bench_bptt(opts: &BpttBenchOptions) -> Result<BpttBenchReport> {
    let spec = all_to_all_glif3(opts.n_cells, 50, 2024);
    let input = InputSpec {
        spike_trains: None,
        poisson: Some(PoissonSpec {
            rates_hz: vec![20.0; 50],
            seed: 7,
        }),
    };
    let mut runs = Vec::new();
    // Segmented first: the allocator keeps freed memory, so the smaller run must not follow
    // the larger one for its peak to be visible.
    for chunk in [Some(opts.chunk.max(1)), None] {
        let topts = BpttOptions {
            seq_len: opts.seq_len,
            gradient_checkpointing: chunk,
            losses: vec![Loss::TargetFiringRate {
                target: vec![10.0; opts.n_cells],
                units: RateUnits::Hz,
            }],
            parallel: opts.parallel,
            ..Default::default()
        };
        let model = SnnModel::new(&spec, opts.dt, &input, topts)?;
        let mut params = model.initial_params();
        let base = memory::rss_bytes();
        let can_reset = memory::reset_peak_rss();
        let _ = model.loss_and_grad(&params, 0, opts.batch)?; // warm-up (counted in the peak)
        let t = std::time::Instant::now();
        let mut loss = 0.0;
        for r in 0..opts.repeats.max(1) {
            let lg = model.loss_and_grad(&params, (r * opts.batch) as u64, opts.batch)?;
            model.constrain(&mut params);
            loss = lg.loss;
        }
        let s_per_step = t.elapsed().as_secs_f64() / opts.repeats.max(1) as f64;
        let peak = match (can_reset, base, memory::peak_rss_bytes()) {
            (true, Some(b), Some(h)) => Some(h.saturating_sub(b)),
            _ => None,
        };
        let (full_b, seg_b) = model.tape_bytes_per_sample();
        let per_sample = if chunk.is_some() { seg_b } else { full_b };
        let concurrent = if opts.parallel {
            rayon::current_num_threads().min(opts.batch)
        } else {
            1
        };
        runs.push(BpttBenchRun {
            chunk,
            s_per_step,
            peak_rss_bytes: peak,
            tape_bytes_per_sample: per_sample,
            tape_bytes_concurrent: per_sample * concurrent,
            loss,
        });
    }
    let full = runs.pop().expect("two runs");
    let segmented = runs.pop().expect("two runs");
    Ok(BpttBenchReport {
        n_cells: opts.n_cells,
        n_params: spec.recurrent_edges.len(),
        batch: opts.batch,
        seq_len: opts.seq_len,
        dt: opts.dt,
        tape_memory_ratio: segmented.tape_bytes_per_sample as f64
            / full.tape_bytes_per_sample as f64,
        rss_memory_ratio: match (segmented.peak_rss_bytes, full.peak_rss_bytes) {
            (Some(s), Some(f)) if f > 0 => Some(s as f64 / f as f64),
            _ => None,
        },
        time_ratio: segmented.s_per_step / full.s_per_step,
        full,
        segmented,
    })
}
