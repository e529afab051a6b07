//! `lockstep bench bptt`: seconds per optimizer step and memory of BPTT (lockstep-snn).
//!
//! Without `--config`: the 300-cell all-to-all GLIF3 network, with and without segmented
//! recompute. With `--config CONFIG` (repeatable): the model, batch, precision and optimizer
//! of any training config, one process using all cores: the median seconds per optimizer
//! step after warm-up with its split (forward, recompute, backward, optimizer), the peak
//! resident memory and bytes per recurrent edge, and the achieved bandwidth of the adjoint's
//! transposed SpMV against a `memcpy` of the same edge arrays in the same run, on the SpMV's
//! threads (and, for reference, on one). In the scatter form (full V1) also the split of the
//! SpMV into the scatter and the windowed weight gradient, and the scatter's floor on this
//! machine: its per-edge work alone (a random read-modify-write of a cache-resident
//! `[batch]` row, the edges streamed; [`row_update_s_per_edge`]) times the step's edge
//! visits, measured in the same run. On a GPU the training state stays on the device as
//! `lockstep train` keeps it with one replica (the update is a kernel): a step is one
//! submission (the forward pass, the loss sums on the device, the backward pass) and one
//! wait at its end, so the split's "forward" is the host's recording of the forward pass and
//! "backward" the rest, the GPU's work included; the step's total is what to read.
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
    #[arg(allow_negative_numbers = true, long, default_value_t = 300)]
    pub cells: usize,
    /// Samples per step.
    #[arg(allow_negative_numbers = true, long, default_value_t = 16)]
    pub batch: usize,
    /// Steps per sample.
    #[arg(allow_negative_numbers = true, long, default_value_t = 500)]
    pub seq_len: usize,
    /// Time step (ms).
    #[arg(allow_negative_numbers = true, long, default_value_t = 1.0)]
    pub dt: f64,
    /// Segmented-BPTT chunk (steps).
    #[arg(allow_negative_numbers = true, long, default_value_t = 25)]
    pub chunk: usize,
    /// Timed steps per configuration.
    #[arg(allow_negative_numbers = true, long, default_value_t = 3)]
    pub repeats: usize,
    /// Training configs to measure instead of the all-to-all network (repeatable; measured
    /// in the order given, in this one run).
    #[arg(long)]
    pub config: Vec<std::path::PathBuf>,
    /// Untimed warm-up steps per config (with `--config`).
    #[arg(allow_negative_numbers = true, long, default_value_t = 1)]
    pub warmup: usize,
    /// Where the configs' BPTT computes, in place of their `run.device`: `cpu`, `gpu` (the
    /// first adapter of `lockstep info`) or `gpu:N` (with `--config`).
    #[arg(long)]
    pub device: Option<lockstep_snn::DeviceRequest>,
    /// With a GPU: also compare N samples (one call each, from the initial weights) with the
    /// float32 CPU engine: the fraction of (sample, neuron, step) spike states that agree,
    /// and the gradient's relative L2 distance where every spike agrees (0: no comparison).
    #[arg(allow_negative_numbers = true, long, default_value_t = 0)]
    pub check_cpu: usize,
    /// A Python interpreter with torch, numpy and h5py: runs the PyTorch peer of the same
    /// step (`scripts/peers/bptt_torch.py`) on each config after lockstep's measurement, on
    /// CUDA when lockstep measured a GPU, on CPU cores otherwise, and prints the ratio.
    #[arg(long)]
    pub python: Option<String>,
    /// With a GPU: the DRAM bandwidth (bytes/s) of the printed traffic model (default an
    /// H200's 4.8 TB/s; the model is labelled as one, beside the measured time).
    #[arg(allow_negative_numbers = true, long, default_value_t = 4.8e12)]
    pub bandwidth: f64,
    /// With a GPU: the L2 bandwidth (bytes/s) for the traffic model's second figure, which
    /// adds the L2 traffic's time (default 7 TB/s, about what microbenchmarks report for
    /// H100-class parts; an assumption, not an NVIDIA figure).
    #[arg(allow_negative_numbers = true, long, default_value_t = 7e12)]
    pub l2_bandwidth: f64,
    /// With a GPU: the L2 size of the traffic model (MB; an H200's 50).
    #[arg(allow_negative_numbers = true, long, default_value_t = 50.0)]
    pub l2_mb: f64,
    /// With a GPU: the GPU time the traffic model charges per kernel launch (microseconds).
    #[arg(allow_negative_numbers = true, long, default_value_t = 4.0)]
    pub launch_us: f64,
}

/// The PyTorch peer (`scripts/peers/bptt_torch.py`), embedded so the binary runs it anywhere.
const TORCH_PEER: &str = include_str!("../../../../scripts/peers/bptt_torch.py");

/// Runs the PyTorch peer on `config` and returns its JSON report with its printed lines.
fn torch_peer(
    python: &str,
    config: &std::path::Path,
    cuda: bool,
    repeats: usize,
    warmup: usize,
) -> Result<(serde_json::Value, String)> {
    use anyhow::Context;
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let script = dir.path().join("bptt_torch.py");
    std::fs::write(&script, TORCH_PEER)?;
    let json = dir.path().join("out.json");
    let out = std::process::Command::new(python)
        .arg(&script)
        .arg("--config")
        .arg(config)
        .args(["--device", if cuda { "cuda" } else { "cpu" }])
        .args(["--repeats", &repeats.max(1).to_string()])
        .args(["--warmup", &warmup.to_string()])
        .arg("--json")
        .arg(&json)
        .output()
        .with_context(|| format!("could not start `{python}`"))?;
    if !out.status.success() {
        anyhow::bail!(
            "the PyTorch peer failed ({}); it needs torch, numpy and h5py in `{python}`: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let report = serde_json::from_str(&std::fs::read_to_string(&json)?)?;
    Ok((report, String::from_utf8_lossy(&out.stdout).into_owned()))
}

/// Runs both configurations and prints the comparison.
pub fn run(args: &BpttArgs) -> Result<()> {
    if !args.config.is_empty() {
        return run_configs(args);
    }
    if args.device.is_some() {
        anyhow::bail!("--device needs --config (the training configs to measure)");
    }
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

/// Median of `v` (NaN when empty).
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    match n {
        0 => f64::NAN,
        _ if n % 2 == 1 => v[n / 2],
        _ => 0.5 * (v[n / 2 - 1] + v[n / 2]),
    }
}

/// Report of [`bench_config`].
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigBenchReport {
    /// The config.
    pub config: std::path::PathBuf,
    /// Cells.
    pub n_cells: usize,
    /// Recurrent edges.
    pub n_recurrent_edges: usize,
    /// Local batch (`run.batch_size`).
    pub batch: usize,
    /// Steps per sample.
    pub seq_len: usize,
    /// Precision.
    pub dtype: lockstep_snn::Dtype,
    /// Median seconds per optimizer step (loss, gradient, optimizer update, sign constraint).
    pub s_per_step: f64,
    /// Medians of the split: forward, recompute, backward (with the SpMV), adjoint SpMV,
    /// optimizer (update and constraint).
    pub split_s: [f64; 5],
    /// Peak resident memory of the process while building and stepping this config (bytes),
    /// when the kernel allows resetting the peak.
    pub peak_rss_bytes: Option<u64>,
    /// The memory `lockstep train` expects one replica to need for the local batch (bytes):
    /// the replica's estimate with the gradient and optimizer buffers
    /// ([`lockstep_train::job::replica_memory_estimate`]).
    pub estimate_bytes: u64,
    /// Achieved bandwidth of the adjoint SpMV over the edge arrays (target offset + weight,
    /// 8 bytes per edge visit, in the gather form; source + weight, 6 bytes, in the scatter
    /// form), bytes/s.
    pub spmv_bytes_per_s: f64,
    /// Whether the adjoint SpMV took the scatter form (`lockstep_snn::SpmvForm`).
    pub spmv_scatter: bool,
    /// `memcpy` of the same edge arrays on one thread (bytes copied / s, best of 5).
    pub memcpy_1_bytes_per_s: f64,
    /// `memcpy` of the same edge arrays split over all the rayon pool's threads, as the
    /// SpMV is (bytes copied / s, best of 5): the yardstick of the SpMV's bandwidth.
    pub memcpy_bytes_per_s: f64,
    /// Median seconds per step of the scatter form's windowed recurrent weight gradient,
    /// part of the adjoint SpMV's (`split_s[3]`); 0 in the gather form.
    pub weight_grad_s: f64,
    /// Median seconds per step of the adjoint SpMV without the windowed weight gradient
    /// (the scatter alone; in the gather form, which adds the gradient edge by edge,
    /// `split_s[3]`).
    pub spmv_alone_s: f64,
    /// Recurrent edge visits of the adjoint SpMV per optimizer step (every edge at every
    /// backward step whose arrival lies within the sequence).
    pub adjoint_edges_per_step: f64,
    /// In the scatter form, its work per edge visit alone on this machine, on the pool's
    /// threads (seconds per edge, best of 5; [`row_update_s_per_edge`]), with rows drawn
    /// from blocks of the kernel's size (`[SCATTER_BLOCK, batch]`, in L2) and from blocks
    /// of [`L1_BLOCK_BYTES`]: the scatter's floor per step is `adjoint_edges_per_step`
    /// times the smaller. `None` in the gather form.
    pub row_update_s_per_edge: Option<[f64; 2]>,
    /// Loss of the last step.
    pub loss: f64,
    /// Mean firing rate of the last step (Hz).
    pub mean_rate_hz: f64,
    /// On a GPU: the adapter (`SnnModel::device_description`), the device bytes the
    /// engine allocated for the local batch, and its device-to-device copy bandwidth over
    /// the recurrent edge arrays' bytes (bytes/s, best of 5). `None` on CPU cores.
    pub gpu: Option<GpuBench>,
}

/// The GPU part of a [`ConfigBenchReport`].
#[derive(Debug, Clone, PartialEq)]
pub struct GpuBench {
    /// The adapter and how it was chosen.
    pub adapter: String,
    /// Device memory the engine allocated for the local batch (bytes).
    pub device_bytes: u64,
    /// Device memory of the training state kept there (parameters, gradient, optimizer
    /// slots, sign codes; bytes).
    pub training_state_bytes: u64,
    /// The device's copy bandwidth for the recurrent edge arrays' bytes (bytes/s).
    pub copy_bytes_per_s: f64,
    /// Bytes of recurrent edge arrays the backward pass reads per optimizer step: each
    /// source's out-edges (4-byte target, 4-byte weight) once per backward step. Over the
    /// whole backward time this gives a lower bound of the adjoint pass's bandwidth.
    pub adjoint_edge_bytes: f64,
    /// The last step's kernel launches, host synchronisations and transfers, as the engine
    /// counted them (the same on any adapter).
    pub counts: Option<lockstep_snn::DeviceCounts>,
    /// The step's shape for the traffic model ([`super::gpu_traffic`]), with the last step's
    /// measured spike probability.
    pub traffic: super::gpu_traffic::Shape,
}

/// `dst.copy_from_slice(src)` in `parts` equal pieces, one rayon task each (`parts` 1: on
/// the calling thread).
///
/// # Panics
/// If the slices' lengths differ.
fn par_copy<T: Copy + Send + Sync>(dst: &mut [T], src: &[T], parts: usize) {
    use rayon::prelude::*;
    assert_eq!(dst.len(), src.len(), "memcpy of slices of unequal length");
    if parts <= 1 {
        dst.copy_from_slice(src);
        return;
    }
    let piece = src.len().div_ceil(parts).max(1);
    dst.par_chunks_mut(piece)
        .zip(src.par_chunks(piece))
        .for_each(|(d, s)| d.copy_from_slice(s));
}

/// `gz[src_e] += w_e * row` for every edge `e` (`src`, `w`: `[edge]`; `row`: `[nb]`; `gz`:
/// `[block, nb]` float32 rows): the scatter form's adjoint SpMV reduced to its per-edge work,
/// without its row pointers, classes and adjoint-ring reads. The lanes go in register-sized
/// blocks of 16, 8 and 1, outermost, as in the kernel.
///
/// # Panics
/// If `src` and `w` differ in length or a source's row lies outside `gz`.
#[inline(always)]
fn row_updates(src: &[u16], w: &[f32], row: &[f32], gz: &mut [f32]) {
    assert_eq!(src.len(), w.len(), "sources and weights of unequal length");
    let nb = row.len();
    let mut l0 = 0;
    while l0 < nb {
        l0 += match nb - l0 {
            16.. => row_update_lanes::<16>(src, w, row, gz, l0),
            8.. => row_update_lanes::<8>(src, w, row, gz, l0),
            _ => row_update_lanes::<1>(src, w, row, gz, l0),
        };
    }
}

/// [`row_updates`] for lanes `l0 .. l0 + L`; returns `L`.
#[inline(always)]
fn row_update_lanes<const L: usize>(
    src: &[u16],
    w: &[f32],
    row: &[f32],
    gz: &mut [f32],
    l0: usize,
) -> usize {
    let nb = row.len();
    let r: [f32; L] = row[l0..l0 + L].try_into().expect("L lanes");
    for (&s, &w) in src.iter().zip(w) {
        let g: &mut [f32; L] = (&mut gz[s as usize * nb + l0..][..L])
            .try_into()
            .expect("L lanes");
        for l in 0..L {
            g[l] += w * r[l];
        }
    }
    L
}

/// [`row_updates`] compiled for AVX2, as the library's scatter kernel is.
///
/// # Safety
/// The CPU must support AVX2.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn row_updates_avx2(src: &[u16], w: &[f32], row: &[f32], gz: &mut [f32]) {
    row_updates(src, w, row, gz)
}

/// The adjoint SpMV's work per edge visit alone, measured on this machine (seconds per
/// edge, best of `rounds`): `n_edges` read-modify-writes `gz[s] += w * row` of an `nb`-lane
/// float32 row `s` drawn at random from a block of `block` rows (the scatter form's block
/// of sources, [`lockstep_snn::SCATTER_BLOCK`]: 256 KB at batch 16, resident in a core's
/// L2 cache; or [`L1_BLOCK_BYTES`] of rows, resident in L1), with the sources (`u16`) and weights (`f32`) streamed from memory, split over
/// `parts` rayon tasks with a block each. This is what the scatter form must do per edge
/// and step at the least; the kernel's time over `edges × this` is its overhead (row
/// pointers, classes, the adjoint ring's reads, scheduling).
///
/// # Panics
/// If `block` exceeds 65,536 (sources are `u16`) or is 0.
fn row_update_s_per_edge(
    n_edges: usize,
    nb: usize,
    block: usize,
    parts: usize,
    rounds: usize,
) -> f64 {
    use rayon::prelude::*;
    assert!((1..=1 << 16).contains(&block), "block of {block} rows");
    let parts = parts.max(1);
    let mut rng = lockstep_core::rng::SplitMix64::new(0x5ca7_7e12);
    let src: Vec<u16> = (0..n_edges)
        .map(|_| (rng.next_u64() % block as u64) as u16)
        .collect();
    let w: Vec<f32> = (0..n_edges).map(|e| 0.5 + (e % 13) as f32 * 0.01).collect();
    let row: Vec<f32> = (0..nb).map(|l| 0.01 * l as f32).collect();
    let mut gz = vec![0.0f32; parts * block * nb];
    let piece = n_edges.div_ceil(parts).max(1);
    #[cfg(target_arch = "x86_64")]
    let avx2 = std::arch::is_x86_feature_detected!("avx2");
    #[cfg(not(target_arch = "x86_64"))]
    let avx2 = false;
    let mut best = f64::INFINITY;
    for _ in 0..rounds.max(1) {
        let clock = std::time::Instant::now();
        gz.par_chunks_mut(block * nb)
            .zip(src.par_chunks(piece).zip(w.par_chunks(piece)))
            .for_each(|(g, (s, w))| {
                if avx2 {
                    // SAFETY: the CPU has AVX2 (checked at run time).
                    #[cfg(target_arch = "x86_64")]
                    unsafe {
                        row_updates_avx2(s, w, &row, g)
                    }
                } else {
                    row_updates(s, w, &row, g);
                }
            });
        best = best.min(clock.elapsed().as_secs_f64());
        std::hint::black_box(&gz);
    }
    best / n_edges.max(1) as f64
}

/// Bytes of the blocks of rows of the second yardstick of the scatter
/// ([`ConfigBenchReport::row_update_s_per_edge`]): a quarter of a Zen 3 core's 32 KB L1 data
/// cache, so that the rows stay there beside the streamed edges (a block size the kernel
/// cannot use: each block re-reads the adjoint rows of every target).
const L1_BLOCK_BYTES: usize = 8 * 1024;

/// The best of 5 copies of the SpMV's edge arrays (target offsets `off`, weights `w`) on
/// one thread and on `threads` threads: seconds `[one, threads]`.
fn memcpy_seconds(off: &[u32], w: &[f32], threads: usize) -> [f64; 2] {
    let mut off_dst = vec![0u32; off.len()];
    let mut w_dst = vec![0f32; w.len()];
    let mut best = [f64::INFINITY; 2];
    for _ in 0..5 {
        for (k, parts) in [1, threads].into_iter().enumerate() {
            let clock = std::time::Instant::now();
            par_copy(&mut off_dst, off, parts);
            par_copy(&mut w_dst, w, parts);
            best[k] = best[k].min(clock.elapsed().as_secs_f64());
            std::hint::black_box((&off_dst, &w_dst));
        }
    }
    best
}

/// Measures one training config: `warmup` untimed steps, then `repeats` timed steps.
///
/// `device` replaces the config's `run.device` when given.
pub fn bench_config(
    config: &std::path::Path,
    repeats: usize,
    warmup: usize,
    device: Option<lockstep_snn::DeviceRequest>,
) -> Result<ConfigBenchReport> {
    use anyhow::Context;
    let can_reset = memory::reset_peak_rss();
    let replica = lockstep_snn::SnnReplica::from_config_on_device(config, true, 0, device)?;
    let json: serde_json::Value = lockstep_sonata::SonataConfig::from_file(config)?.json;
    let engine =
        lockstep_train::EngineConfig::from_json(&json, &lockstep_core::config::config_dir(config))
            .with_context(|| format!("{}", config.display()))?;
    let estimate_bytes =
        lockstep_train::job::replica_memory_estimate(&replica, engine.batch_size, &engine).total();
    let (batch, opt_cfg) = (engine.batch_size, engine.optimizer);
    let model = replica.model();
    let mut params = model.initial_params();
    let mut opt = lockstep_train::Optimizer::new(opt_cfg, params.len());
    let mut steps = Vec::new();
    let mut split: [Vec<f64>; 5] = Default::default();
    let (mut edge_bytes, mut spmv_s, mut scatter) = (0u64, 0.0f64, false);
    let (mut edge_visits, mut weight_grad, mut spmv_alone) = (0u64, Vec::new(), Vec::new());
    let mut last = None;
    let mut device_counts = None;
    // On a GPU the training state stays there as `lockstep train` keeps it (one replica):
    // the update is a kernel, and its launch is counted with the pass's.
    let on_device = model.keeps_training_state_on_device();
    if on_device {
        model.upload_training_state(&params, &opt.slots)?;
    }
    for r in 0..warmup + repeats.max(1) {
        let clock = std::time::Instant::now();
        let first = (r * batch) as u64;
        let (lg, mut t) = if on_device {
            model.loss_and_grad_on_device_timed(first, batch)?
        } else {
            model.loss_and_grad_timed(&params, first, batch)?
        };
        let opt_clock = std::time::Instant::now();
        if on_device {
            let step = opt.device_update(1.0, 1.0);
            let launches = model.finish_device_update(Some(&step), None)?;
            if let Some(d) = &mut t.device {
                d.launches += launches;
            }
        } else {
            opt.update(&mut params, &lg.grad);
            model.constrain(&mut params);
        }
        let opt_s = opt_clock.elapsed().as_secs_f64();
        device_counts = t.device;
        if r >= warmup {
            steps.push(clock.elapsed().as_secs_f64());
            for (v, x) in split.iter_mut().zip([
                t.forward_s,
                t.recompute_s,
                t.backward_s,
                t.adjoint_spmv_s,
                opt_s,
            ]) {
                v.push(x);
            }
            edge_bytes += t.adjoint_edge_bytes;
            edge_visits += t.adjoint_edges;
            weight_grad.push(t.weight_grad_s);
            spmv_alone.push(t.adjoint_spmv_s - t.weight_grad_s);
            spmv_s += t.adjoint_spmv_s;
            scatter = t.adjoint_scatter;
        }
        last = Some(lg);
    }
    let training_state_bytes = model.training_state_bytes().unwrap_or(0);
    if on_device {
        // Waits for the last update (the timed steps waited for every earlier one).
        model.download_training_state(&mut params, &mut opt.slots)?;
        model.release_training_state();
    }
    let peak = if can_reset {
        memory::peak_rss_bytes()
    } else {
        None
    };
    // memcpy of the SpMV's edge arrays (target offsets and weights), best of 5, on one
    // thread and on all of the pool's threads (the SpMV's).
    let off = &model.net.recurrent.target_off;
    let w = &params[..model.n_recurrent_params()];
    let threads = rayon::current_num_threads();
    let best = memcpy_seconds(off, w, threads);
    let bytes = 4.0 * (off.len() + w.len()) as f64;
    let row_update = scatter.then(|| {
        let l1_rows = (L1_BLOCK_BYTES / (4 * batch.max(1))).max(1);
        [lockstep_snn::SCATTER_BLOCK, l1_rows]
            .map(|rows| row_update_s_per_edge(off.len(), batch, rows, threads, 5))
    });
    let timed = steps.len();
    let last = last.expect("at least one step");
    let gpu = match model.device_copy_bytes_per_s(bytes as u64, 5)? {
        Some(copy_bytes_per_s) => Some(GpuBench {
            adapter: model.device_description(),
            device_bytes: model.prepare_device(batch)?,
            training_state_bytes,
            copy_bytes_per_s,
            adjoint_edge_bytes: 8.0
                * model.n_recurrent_params() as f64
                * model.options().seq_len as f64,
            counts: device_counts,
            traffic: super::gpu_traffic::shape_of(
                model,
                batch,
                last.n_spikes as f64
                    / (model.net.n_neurons() * model.options().seq_len * batch).max(1) as f64,
            ),
        }),
        None => None,
    };
    Ok(ConfigBenchReport {
        config: config.to_path_buf(),
        n_cells: model.net.n_neurons(),
        n_recurrent_edges: model.n_recurrent_params(),
        batch,
        seq_len: model.options().seq_len,
        dtype: model.options().dtype,
        s_per_step: median(steps),
        split_s: split.map(median),
        peak_rss_bytes: peak,
        estimate_bytes,
        spmv_bytes_per_s: if spmv_s > 0.0 {
            edge_bytes as f64 / spmv_s
        } else {
            f64::NAN
        },
        memcpy_1_bytes_per_s: bytes / best[0],
        memcpy_bytes_per_s: bytes / best[1],
        weight_grad_s: median(weight_grad),
        spmv_alone_s: median(spmv_alone),
        adjoint_edges_per_step: edge_visits as f64 / timed.max(1) as f64,
        row_update_s_per_edge: row_update,
        spmv_scatter: scatter,
        loss: last.loss,
        mean_rate_hz: last.mean_rate_hz,
        gpu,
    })
}

/// The GPU engine against the float32 CPU engine on one config ([`check_against_cpu`]).
#[derive(Debug, Clone, PartialEq)]
pub struct CpuCheck {
    /// Samples compared (one call each, samples `0..samples`, the initial weights).
    pub samples: usize,
    /// (sample, neuron, step) states compared.
    pub states: u64,
    /// Of which the spike differs (fired on one engine only).
    pub differing: u64,
    /// `1 - differing / states`.
    pub agree_fraction: f64,
    /// Samples whose spikes agree at every neuron and step.
    pub equal_samples: usize,
    /// Relative L2 distance of the summed gradient of those samples (GPU against CPU);
    /// `None` when there are none.
    pub grad_rel_l2_where_equal: Option<f64>,
}

/// Compares the GPU engine (`device`, default `gpu`) with the float32 CPU engine on
/// `samples` samples of `config`: per sample, the spikes of every neuron at every step and
/// the gradient, from the initial weights (issue 46's check on real GPUs, where fused
/// multiply-adds may move a spike).
///
/// Errors: the config's, or the device's.
pub fn check_against_cpu(
    config: &std::path::Path,
    device: Option<lockstep_snn::DeviceRequest>,
    samples: usize,
) -> Result<CpuCheck> {
    let gpu_req = device.unwrap_or(lockstep_snn::DeviceRequest::Gpu(None));
    let (_, mut gpu) = lockstep_snn::model_from_config_on_device(config, 0, Some(gpu_req))?;
    let (_, mut cpu) = lockstep_snn::model_from_config_on_device(
        config,
        0,
        Some(lockstep_snn::DeviceRequest::Cpu),
    )?;
    gpu.opts.record_first_sample = true;
    cpu.opts.record_first_sample = true;
    cpu.opts.parallel = true;
    let p = cpu.initial_params();
    let per_sample = (cpu.net.n_neurons() * cpu.options().seq_len) as u64;
    let (mut differing, mut equal_samples) = (0u64, 0usize);
    let (mut ga, mut gb) = (vec![0f64; p.len()], vec![0f64; p.len()]);
    for s in 0..samples as u64 {
        let a = cpu.loss_and_grad(&p, s, 1)?;
        let b = gpu.loss_and_grad(&p, s, 1)?;
        let (sa, sb) = (
            a.first_spikes.unwrap_or_default(),
            b.first_spikes.unwrap_or_default(),
        );
        // Both lists are sorted (step, node): count the symmetric difference.
        let (mut i, mut j, mut common) = (0, 0, 0u64);
        while i < sa.len() && j < sb.len() {
            match sa[i].cmp(&sb[j]) {
                std::cmp::Ordering::Less => i += 1,
                std::cmp::Ordering::Greater => j += 1,
                std::cmp::Ordering::Equal => {
                    common += 1;
                    i += 1;
                    j += 1;
                }
            }
        }
        let diff = (sa.len() as u64 - common) + (sb.len() as u64 - common);
        differing += diff;
        if diff == 0 {
            equal_samples += 1;
            for (acc, g) in ga.iter_mut().zip(&a.grad) {
                *acc += *g as f64;
            }
            for (acc, g) in gb.iter_mut().zip(&b.grad) {
                *acc += *g as f64;
            }
        }
    }
    let states = per_sample * samples as u64;
    let grad = (equal_samples > 0).then(|| {
        let num: f64 = ga.iter().zip(&gb).map(|(a, b)| (a - b).powi(2)).sum();
        let den: f64 = ga.iter().map(|a| a * a).sum();
        (num / den.max(1e-300)).sqrt()
    });
    Ok(CpuCheck {
        samples,
        states,
        differing,
        agree_fraction: 1.0 - differing as f64 / states.max(1) as f64,
        equal_samples,
        grad_rel_l2_where_equal: grad,
    })
}

/// The GPU lines of a config's report: the device, the backward pass's edge bandwidth
/// against a device copy, and the agreement with the CPU engine when checked.
fn print_gpu_report(
    r: &ConfigBenchReport,
    g: &GpuBench,
    check: Option<&CpuCheck>,
    args: &BpttArgs,
) {
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    println!(
        "  on {}: a call (forward pass, loss sums, backward pass) is one submission; device memory {:.3} GiB for the batch ({:.0} bytes per recurrent edge) and {:.3} GiB of training state (weights, gradient, optimizer slots)",
        g.adapter,
        gib(g.device_bytes),
        g.device_bytes as f64 / r.n_recurrent_edges.max(1) as f64,
        gib(g.training_state_bytes)
    );
    println!(
        "  the backward pass reads the recurrent edge arrays at {:.2} GB/s or more ({:.3e} bytes per step over its {:.3} s, its other kernels included); device-to-device copy of them {:.2} GB/s (ratio {:.3})",
        g.adjoint_edge_bytes / r.split_s[2] / 1e9,
        g.adjoint_edge_bytes,
        r.split_s[2],
        g.copy_bytes_per_s / 1e9,
        g.adjoint_edge_bytes / r.split_s[2] / g.copy_bytes_per_s
    );
    if let Some(c) = &g.counts {
        println!(
            "  per optimizer step (counted, the same on any adapter with the same kernels, 64- or 32-bit): {} kernel launches ({:.2} per time step), {} host synchronisations, {} bytes read back ({:.3} MB), {} bytes uploaded ({:.3} MB)",
            c.launches,
            c.launches as f64 / r.seq_len.max(1) as f64,
            c.host_syncs,
            c.bytes_to_host,
            c.bytes_to_host as f64 / 1e6,
            c.bytes_to_device,
            c.bytes_to_device as f64 / 1e6
        );
    }
    super::gpu_traffic::print(
        &g.traffic,
        args.l2_mb * 1e6,
        args.bandwidth,
        args.l2_bandwidth,
        args.launch_us * 1e-6,
        r.s_per_step,
    );
    if let Some(k) = check {
        println!(
            "  against the float32 CPU engine, {} samples of {} steps: {:.5}% of (sample, neuron, step) spike states agree ({} of {} differ); gradient relative L2 {}",
            k.samples,
            r.seq_len,
            100.0 * k.agree_fraction,
            k.differing,
            k.states,
            k.grad_rel_l2_where_equal
                .map(|d| format!("{d:.3e} over the {} samples whose spikes all agree", k.equal_samples))
                .unwrap_or_else(|| "n/a (no sample's spikes agree throughout)".into())
        );
    }
}

/// The CPU lines of a config's report: the adjoint SpMV's bandwidth against memcpy, and its
/// scatter against the per-edge floor.
fn print_cpu_report(r: &ConfigBenchReport, threads: usize) {
    println!(
        "  adjoint SpMV ({} form) streams the edge arrays at {:.2} GB/s; memcpy of them {:.2} GB/s on {} threads, {:.2} GB/s on one (ratio to {} threads {:.2})",
        if r.spmv_scatter { "scatter" } else { "gather" },
        r.spmv_bytes_per_s / 1e9,
        r.memcpy_bytes_per_s / 1e9,
        threads,
        r.memcpy_1_bytes_per_s / 1e9,
        threads,
        r.spmv_bytes_per_s / r.memcpy_bytes_per_s
    );
    if let Some([l2, l1]) = r.row_update_s_per_edge {
        let floor = r.adjoint_edges_per_step * l2.min(l1);
        println!(
            "  adjoint SpMV {:.3} s = scatter {:.3} s + windowed weight gradient {:.3} s; the scatter's work per edge alone (a random read-modify-write of a {}-byte row, the edges streamed) {:.3} ns/edge in {} KB blocks (the kernel's), {:.3} ns/edge in {} KB blocks, on {} threads: at least {:.3} s for the step's {:.4e} edge visits (scatter / that {:.2}; / the kernel's blocks' {:.2})",
            r.split_s[3],
            r.spmv_alone_s,
            r.weight_grad_s,
            4 * r.batch,
            l2 * 1e9,
            lockstep_snn::SCATTER_BLOCK * 4 * r.batch / 1024,
            l1 * 1e9,
            L1_BLOCK_BYTES / 1024,
            threads,
            floor,
            r.adjoint_edges_per_step,
            r.spmv_alone_s / floor,
            r.spmv_alone_s / (r.adjoint_edges_per_step * l2)
        );
    }
}

fn run_configs(args: &BpttArgs) -> Result<()> {
    // --cpu wins over the configs' run.device and is refused with a --device of a GPU.
    let device = match (crate::flags::cpu_only(), args.device) {
        (true, Some(d @ lockstep_snn::DeviceRequest::Gpu(_))) => {
            anyhow::bail!("--cpu and --device {d} ask for different devices; give one of them")
        }
        (true, _) => Some(lockstep_snn::DeviceRequest::Cpu),
        (false, d) => d,
    };
    let threads = rayon::current_num_threads();
    println!(
        "BPTT per optimizer step, {} rayon threads, median of {} steps after {} warm-up",
        threads,
        args.repeats.max(1),
        args.warmup
    );
    for c in &args.config {
        let r = bench_config(c, args.repeats, args.warmup, device)?;
        let peer = match &args.python {
            Some(py) => Some(torch_peer(
                py,
                c,
                r.gpu.is_some(),
                args.repeats,
                args.warmup,
            )?),
            None => None,
        };
        let print_peer = || {
            if let Some((p, lines)) = &peer {
                let t = p["s_per_step"].as_f64().unwrap_or(f64::NAN);
                for l in lines.lines() {
                    println!("  {l}");
                }
                println!(
                    "  PyTorch peer {:.3} s/step: lockstep is {:.2}x as fast",
                    t,
                    t / r.s_per_step
                );
            }
        };
        let check = if args.check_cpu > 0 && r.gpu.is_some() {
            Some(check_against_cpu(c, device, args.check_cpu)?)
        } else {
            None
        };
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        println!(
            "{}: {} cells, {} recurrent edges, batch {}, seq_len {}, dtype {}",
            r.config.display(),
            r.n_cells,
            r.n_recurrent_edges,
            r.batch,
            r.seq_len,
            r.dtype
        );
        println!(
            "  {:.3} s/step = forward {:.3} + recompute {:.3} + backward {:.3} (adjoint SpMV {:.3}) + optimizer {:.3}",
            r.s_per_step, r.split_s[0], r.split_s[1], r.split_s[2], r.split_s[3], r.split_s[4]
        );
        match r.peak_rss_bytes {
            Some(p) => println!(
                "  peak resident {:.2} GiB ({:.0} bytes per recurrent edge); estimate {:.2} GiB",
                gib(p),
                p as f64 / r.n_recurrent_edges.max(1) as f64,
                gib(r.estimate_bytes)
            ),
            None => println!(
                "  peak resident n/a (cannot reset VmHWM); estimate {:.2} GiB",
                gib(r.estimate_bytes)
            ),
        }
        match &r.gpu {
            Some(g) => print_gpu_report(&r, g, check.as_ref(), args),
            None => print_cpu_report(&r, threads),
        }
        println!(
            "  last step: loss {:.6}, mean rate {:.2} Hz",
            r.loss, r.mean_rate_hz
        );
        print_peer();
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{par_copy, row_update_s_per_edge, row_updates};

    #[test]
    fn row_updates_add_each_edge_into_its_source_row_for_any_lane_count() {
        for nb in [1, 5, 8, 16, 21] {
            let src: Vec<u16> = vec![2, 0, 2, 1, 3, 2];
            let w: Vec<f32> = vec![1.0, -2.0, 0.5, 3.0, 0.25, 4.0];
            let row: Vec<f32> = (0..nb).map(|l| 1.0 + l as f32).collect();
            let mut gz = vec![0.0f32; 4 * nb];
            row_updates(&src, &w, &row, &mut gz);
            let mut want = vec![0.0f32; 4 * nb];
            for (&s, &w) in src.iter().zip(&w) {
                for l in 0..nb {
                    want[s as usize * nb + l] += w * row[l];
                }
            }
            assert_eq!(gz, want, "{nb} lanes");
            assert_ne!(gz, vec![0.0; 4 * nb]);
        }
    }

    #[test]
    fn row_update_yardstick_gives_a_positive_time_per_edge() {
        let s = row_update_s_per_edge(10_000, 16, 64, 2, 2);
        assert!(s.is_finite() && s > 0.0 && s < 1e-3, "{s} s per edge");
    }

    #[test]
    fn par_copy_copies_every_element_for_any_split() {
        let src: Vec<u32> = (0..1001).collect();
        for parts in [1, 2, 3, 7, 2000] {
            let mut dst = vec![0u32; src.len()];
            par_copy(&mut dst, &src, parts);
            assert_eq!(dst, src, "{parts} parts");
        }
        let mut empty: Vec<u32> = Vec::new();
        par_copy(&mut empty, &[], 2);
    }
}
