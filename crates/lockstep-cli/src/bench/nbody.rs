//! `lockstep bench nbody`: force evaluations per second of the FMM (N = 1e5, 1e6) and of
//! direct summation (N = 1e5), and the speed and accuracy against the Flatiron FMM3D
//! (`fmm3dpy` from PyPI, run through `python3` in the same run) on the same points with the
//! Laplace kernel and no softening. FMM3D runs at the requested precisions
//! `eps = 1e-2, 1e-3, 1e-4`; the "matched" row is the fastest run whose measured 99th
//! percentile acceleration error is at most ours, and the speed ratio compares with it. Each
//! FMM size also prints the phase profile and the interaction counts of its best evaluation.
//!
//! Accuracy is measured on a subset of targets against direct summation in f64.
//!
//! `lockstep bench nbody --ranks 1,2` runs the sharded benchmark instead
//! ([`bench_nbody_ranks`]); `lockstep bench nbody --accuracy-table [N]` prints the accuracy
//! table of the FMM over its order and opening angle ([`accuracy_table`]).

use std::process::Command;
use std::time::Instant;

use super::npy::{read_npy, write_npy};
use anyhow::{anyhow, bail, Context, Result};
use lockstep_comm::{CommExt, Communicator, ReduceOp};
use lockstep_nbody::accuracy::{compare, Accuracy};
use lockstep_nbody::shard::{redistribute, sharded_forces};
use lockstep_nbody::{
    direct, direct_on, Fmm, FmmParams, FmmStats, Forces, InitialConditions, NearField, SourceSet,
};

/// Options of `lockstep bench nbody`.
#[derive(Debug, clap::Args)]
pub struct BenchNbodyArgs {
    /// Rank counts for the sharded benchmark, e.g. `1,2` (ThreadComm ranks sharing the cores;
    /// with `--device gpu` each rank binds the GPU of its slot, shared when the ranks outnumber
    /// the GPUs); without it: FMM and direct evaluations per second and the comparison with
    /// fmm3dpy.
    #[arg(allow_hyphen_values = true, long, value_delimiter = ',')]
    pub ranks: Option<Vec<usize>>,
    /// Print the accuracy table instead: the 99th percentile error against direct summation
    /// for p = 1..6 and theta in {0.4, 0.6, 0.8} on a Plummer sphere and on Gaussian clumps of
    /// N particles (default 20000).
    #[arg(allow_negative_numbers = true, long, value_name = "N", num_args = 0..=1, default_missing_value = "20000")]
    pub accuracy_table: Option<u64>,
    /// Particles (sharded benchmark).
    #[arg(allow_negative_numbers = true, long, default_value_t = 1_000_000)]
    pub n: usize,
    /// Particle counts of the FMM rows (the default benchmark).
    #[arg(
        allow_hyphen_values = true,
        long,
        value_delimiter = ',',
        default_value = "100000,1000000"
    )]
    pub sizes: Vec<usize>,
    /// Particle counts of the direct-summation rows (the default benchmark; `0` for none).
    #[arg(
        allow_hyphen_values = true,
        long,
        value_delimiter = ',',
        default_value = "100000"
    )]
    pub direct_sizes: Vec<usize>,
    /// FMM expansion order p (default benchmark and sharded benchmark).
    #[arg(allow_negative_numbers = true, long, default_value_t = FmmParams::default().order)]
    pub order: usize,
    /// FMM opening angle theta.
    #[arg(allow_negative_numbers = true, long, default_value_t = FmmParams::default().theta)]
    pub theta: f64,
    /// FMM leaf size (particles per leaf).
    #[arg(allow_negative_numbers = true, long, default_value_t = FmmParams::default().leaf_size)]
    pub leaf_size: usize,
    /// Arithmetic of the FMM near-field sums (`forces.near_field`).
    #[arg(long, value_enum, default_value_t = NearFieldArg::F32)]
    pub near_field: NearFieldArg,
    /// Timed evaluations per configuration (the best is reported).
    #[arg(allow_negative_numbers = true, long, default_value_t = 3)]
    pub repeats: usize,
    /// Skip the comparison with fmm3dpy (Flatiron FMM3D through python3).
    #[arg(long)]
    pub no_fmm3d: bool,
    /// With `--device gpu`: leave out the CPU FMM rows (at N = 1e8 one CPU evaluation takes
    /// minutes even on 16 cores); the GPU rows, split, model and accuracy stay.
    #[arg(long)]
    pub no_cpu_fmm: bool,
    /// Python interpreter that imports fmm3dpy and numpy.
    #[arg(long, default_value = "python3")]
    pub python: String,
    /// Precisions requested from FMM3D.
    #[arg(
        allow_hyphen_values = true,
        long,
        value_delimiter = ',',
        default_value = "1e-2,1e-3,1e-4"
    )]
    pub fmm3d_eps: Vec<f64>,
    /// Where the FMM runs: `cpu` (default) or `gpu` / `gpu:N` (`forces.device`): the GPU
    /// FMM next to the CPU FMM, its split and the H200 model (`bench/nbody_gpu.rs`).
    #[arg(long, default_value = "cpu")]
    pub device: lockstep_nbody::DeviceRequest,
}

/// `--near-field` values (`forces.near_field` of an N-body config).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NearFieldArg {
    /// Single-precision sums on centred, scaled coordinates (the default).
    F32,
    /// Double-precision sums.
    F64,
}

/// The FMM parameters of the arguments.
pub(super) fn params_of(args: &BenchNbodyArgs) -> FmmParams {
    FmmParams {
        order: args.order,
        theta: args.theta,
        leaf_size: args.leaf_size,
        near_field: match args.near_field {
            NearFieldArg::F32 => NearField::F32,
            NearFieldArg::F64 => NearField::F64,
        },
    }
}

/// Runs the benchmark selected by `args` and prints its table.
pub fn run(args: &BenchNbodyArgs) -> Result<()> {
    let params = params_of(args);
    if let Some(n) = args.accuracy_table {
        return accuracy_table(n);
    }
    match &args.ranks {
        Some(ranks) => {
            bench_nbody_ranks(ranks, args.n, params, args.repeats.max(1))?;
        }
        None => {
            let opts = NbodyBenchOptions {
                fmm_sizes: args.sizes.clone(),
                direct_sizes: args
                    .direct_sizes
                    .iter()
                    .copied()
                    .filter(|&n| n > 0)
                    .collect(),
                params,
                repeats: args.repeats.max(1),
                fmm3d: !args.no_fmm3d,
                python: args.python.clone(),
                fmm3d_eps: args.fmm3d_eps.clone(),
                ..NbodyBenchOptions::default()
            };
            let report = bench_nbody(&opts)?;
            if let Some(note) = report.fmm3d_note {
                println!("note: {note}");
            }
        }
    }
    Ok(())
}

/// Benchmark settings.
#[derive(Debug, Clone, PartialEq)]
pub struct NbodyBenchOptions {
    /// Particle counts for the FMM.
    pub fmm_sizes: Vec<usize>,
    /// Particle counts for direct summation.
    pub direct_sizes: Vec<usize>,
    /// FMM parameters.
    pub params: FmmParams,
    /// Timed FMM evaluations per size (the best is reported).
    pub repeats: usize,
    /// Targets used for the accuracy measurement.
    pub accuracy_targets: usize,
    /// Compare with `fmm3dpy` through `python3`.
    pub fmm3d: bool,
    /// Python interpreter.
    pub python: String,
    /// Precisions requested from FMM3D.
    pub fmm3d_eps: Vec<f64>,
    /// Random seed of the Plummer-sphere points.
    pub seed: u64,
}

impl Default for NbodyBenchOptions {
    fn default() -> Self {
        NbodyBenchOptions {
            fmm_sizes: vec![100_000, 1_000_000],
            direct_sizes: vec![100_000],
            params: FmmParams::default(),
            repeats: 3,
            accuracy_targets: 2_000,
            fmm3d: true,
            python: "python3".into(),
            fmm3d_eps: vec![1e-2, 1e-3, 1e-4],
            seed: 2024,
        }
    }
}

/// One row of the benchmark table.
#[derive(Debug, Clone, PartialEq)]
pub struct NbodyBenchRow {
    /// `"fmm"`, `"direct"` or `"fmm3d"`.
    pub method: String,
    /// Particles.
    pub n: usize,
    /// Seconds per force evaluation (best of the repeats).
    pub seconds: f64,
    /// Force evaluations per second.
    pub evals_per_second: f64,
    /// Accuracy against direct summation on the target subset (None for direct).
    pub accuracy: Option<Accuracy>,
    /// Requested precision (FMM3D) or parameters (ours).
    pub setting: String,
    /// Our FMM time / this row's time (FMM3D rows only: > 1 means FMM3D is faster).
    pub speed_ratio: Option<f64>,
}

/// The benchmark result.
#[derive(Debug, Clone, PartialEq)]
pub struct NbodyBenchReport {
    /// Rows in the order measured.
    pub rows: Vec<NbodyBenchRow>,
    /// Worker threads used by rayon.
    pub threads: usize,
    /// Why the FMM3D comparison is missing, if it is.
    pub fmm3d_note: Option<String>,
}

const PY: &str = r#"
import json, sys, time
import numpy as np
import fmm3dpy
d = sys.argv[1]
pos = np.load(d + "/pos.npy")
q = np.load(d + "/mass.npy")
src = np.ascontiguousarray(pos.T)
secs = []
cpus = []
for k, e in enumerate(sys.argv[2:]):
    t0 = time.perf_counter()
    c0 = time.process_time()
    out = fmm3dpy.lfmm3d(eps=float(e), sources=src, charges=q, pg=2)
    secs.append(time.perf_counter() - t0)
    cpus.append(time.process_time() - c0)
    np.save(d + "/pot%d.npy" % k, np.ascontiguousarray(out.pot))
    np.save(d + "/grad%d.npy" % k, np.ascontiguousarray(out.grad.T))
print(json.dumps({"seconds": secs, "cpu_seconds": cpus, "version": getattr(fmm3dpy, "__version__", "unknown")}))
"#;

pub(super) fn plummer_points(n: usize, seed: u64) -> Result<(Vec<[f64; 3]>, Vec<f64>)> {
    let p = InitialConditions::Plummer {
        n: n as u64,
        total_mass: 1.0,
        scale_radius: 1.0,
        max_radius: 30.0,
        seed,
    }
    .generate(1.0, 0, 1, 1.0)?;
    Ok((p.valid_pos().to_vec(), p.valid_mass().to_vec()))
}

/// Runs FMM3D on `pos`/`mass` at each precision of `eps`; returns per precision (wall
/// seconds, CPU seconds of the process, forces in our sign convention with G = 1), and the
/// fmm3dpy version. FMM3D's kernel
/// normalisation (1/r or 1/(4 pi r)) is detected from the potential of the first point.
pub(super) fn run_fmm3d(
    python: &str,
    pos: &[[f64; 3]],
    mass: &[f64],
    eps: &[f64],
    reference: &Forces,
) -> Result<(Vec<Fmm3dRun>, String)> {
    let dir = tempfile::tempdir().context("creating a temporary directory")?;
    let d = dir.path();
    let flat: Vec<f64> = pos.iter().flatten().copied().collect();
    write_npy(&d.join("pos.npy"), &flat, &[pos.len() as u64, 3])?;
    write_npy(&d.join("mass.npy"), mass, &[mass.len() as u64])?;
    let script = d.join("bench_fmm3d.py");
    std::fs::write(&script, PY).with_context(|| format!("writing {}", script.display()))?;
    let out = Command::new(python)
        .arg(&script)
        .arg(d)
        .args(eps.iter().map(|e| format!("{e:e}")))
        .output()
        .map_err(|e| anyhow!("could not start `{python}`: {e}; install Python 3"))?;
    if !out.status.success() {
        bail!(
            "`{python}` with fmm3dpy failed ({}): {}; install it with `pip install fmm3dpy numpy`",
            out.status,
            String::from_utf8_lossy(&out.stderr)
                .lines()
                .last()
                .unwrap_or("")
        );
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .map_err(|e| anyhow!("unexpected fmm3dpy script output: {e}"))?;
    let version = v["version"].as_str().unwrap_or("unknown").to_string();
    let mut res = Vec::new();
    for k in 0..eps.len() {
        let seconds = v["seconds"][k].as_f64().unwrap_or(f64::NAN);
        let cpu_seconds = v["cpu_seconds"][k].as_f64().unwrap_or(f64::NAN);
        let pot = read_npy::<f64>(&d.join(format!("pot{k}.npy")))?;
        let grad = read_npy::<f64>(&d.join(format!("grad{k}.npy")))?;
        if pot.len() != pos.len() || grad.len() != 3 * pos.len() {
            bail!(
                "fmm3dpy returned {} potentials and {} gradient entries for {} points",
                pot.len(),
                grad.len(),
                pos.len()
            );
        }
        // Our potential is -sum m / r; FMM3D's is +sum q / r, possibly divided by 4 pi.
        let ratio = -pot[0] / reference.pot[0];
        let scale = if (ratio * 4.0 * std::f64::consts::PI - 1.0).abs() < 0.1 {
            4.0 * std::f64::consts::PI
        } else {
            1.0
        };
        let f = Forces {
            pot: pot.iter().map(|p| -scale * p).collect(),
            acc: grad
                .chunks_exact(3)
                .map(|g| [scale * g[0], scale * g[1], scale * g[2]])
                .collect(),
        };
        res.push(Fmm3dRun {
            seconds,
            cpu_seconds,
            forces: f,
        });
    }
    Ok((res, version))
}

/// One FMM3D evaluation.
pub(super) struct Fmm3dRun {
    /// Wall-clock seconds.
    pub(super) seconds: f64,
    /// CPU seconds of the Python process during the call (all its threads).
    pub(super) cpu_seconds: f64,
    /// Forces in our sign convention, G = 1.
    pub(super) forces: Forces,
}

fn subset(f: &Forces, k: usize) -> Forces {
    Forces {
        acc: f.acc[..k].to_vec(),
        pot: f.pot[..k].to_vec(),
    }
}

/// Prints the phase profile of the best FMM evaluation (seconds per phase, wall clock; the
/// traversal and the P2P sums run interleaved and are split by their CPU time) and its
/// interaction counts.
fn print_profile(n: usize, st: &FmmStats) {
    let s = &st.seconds;
    println!(
        "  profile N={n}: tree {:.3} s, P2M/M2M {:.3} s, traversal {:.3} s, M2L {:.3} s, L2L {:.3} s, L2P {:.3} s, M2P {:.3} s, P2P {:.3} s",
        s.tree, s.upward, s.traversal, s.m2l, s.l2l, s.l2p, s.m2p, s.p2p
    );
    println!(
        "  counts  N={n}: {} nodes, depth {}, {} M2L, {} M2P, {} P2P blocks, {:.3e} P2P pairs",
        st.nodes, st.depth, st.m2l, st.m2p, st.p2p_blocks, st.p2p_pairs as f64
    );
}

/// Prints the header of the benchmark table.
fn print_header(params: &FmmParams, threads: usize) {
    println!(
        "lockstep bench nbody: Plummer sphere, G = 1, no softening, {threads} threads, FMM p = {}, theta = {}, leaf_size = {}",
        params.order, params.theta, params.leaf_size
    );
    println!(
        "{:<7} {:>9} {:>11} {:>11} {:>10} {:>10} {:>10} {:>13}  setting",
        "method", "N", "s/eval", "evals/s", "acc p50", "acc p99", "pot p99", "t_ours/t_row"
    );
}

/// Prints one row of the benchmark table.
fn print_row(r: &NbodyBenchRow) {
    let (a50, a99, p99) = r
        .accuracy
        .map(|a| {
            (
                format!("{:.2e}", a.acc.p50),
                format!("{:.2e}", a.acc.p99),
                format!("{:.2e}", a.pot.p99),
            )
        })
        .unwrap_or(("-".into(), "-".into(), "-".into()));
    println!(
        "{:<7} {:>9} {:>11.4} {:>11.3} {:>10} {:>10} {:>10} {:>13}  {}",
        r.method,
        r.n,
        r.seconds,
        r.evals_per_second,
        a50,
        a99,
        p99,
        r.speed_ratio
            .map(|s| format!("{s:.2}x"))
            .unwrap_or("-".into()),
        r.setting
    );
}

/// Runs the benchmark and prints its table to stdout.
pub fn bench_nbody(opts: &NbodyBenchOptions) -> Result<NbodyBenchReport> {
    let fmm = Fmm::new(opts.params)?;
    let threads = rayon::current_num_threads();
    let mut rows = Vec::new();
    let mut note = None;
    let mut one_thread = Vec::new();
    print_header(&opts.params, threads);
    for &n in &opts.fmm_sizes {
        let (pos, mass) = plummer_points(n, opts.seed)?;
        let k = opts.accuracy_targets.min(n);
        let reference = direct_on(&pos[..k], Some(0), &pos, &mass, 1.0, 0.0);
        let row = fmm_row(opts, &fmm, &pos, &mass, &reference, threads)?;
        print_row(&row);
        let (ours_seconds, ours_p99) = (row.seconds, row.accuracy.map_or(0.0, |a| a.acc.p99));
        rows.push(row);
        if threads > 1 {
            // The same evaluation on one core: the per-core comparison with a peer that
            // runs on one thread (the PyPI fmm3dpy wheel is built without OpenMP).
            let one = rayon::ThreadPoolBuilder::new()
                .num_threads(1)
                .build()
                .context("a rayon pool of 1 thread")?;
            let row = one.install(|| fmm_row(opts, &fmm, &pos, &mass, &reference, 1))?;
            print_row(&row);
            one_thread.push((n, row.seconds));
            rows.push(row);
        }
        if opts.fmm3d && note.is_none() {
            match run_fmm3d(&opts.python, &pos, &mass, &opts.fmm3d_eps, &reference) {
                Ok((runs, version)) => {
                    let peer =
                        fmm3d_rows(opts, n, &runs, &version, &reference, ours_seconds, ours_p99);
                    for row in &peer {
                        print_row(row);
                    }
                    if let Some(m) = peer.iter().find(|r| r.setting.ends_with("(matched)")) {
                        let one = one_thread.iter().find(|&&(k, _)| k == n).map(|&(_, s)| s);
                        println!(
                            "  speed N={n}: fmm3d matched / ours = {:.2} ({threads} threads){}",
                            m.seconds / ours_seconds,
                            one.map(|s| format!(", {:.2} (ours on 1 thread)", m.seconds / s))
                                .unwrap_or_default()
                        );
                    }
                    rows.extend(peer);
                }
                Err(e) => {
                    println!("fmm3d comparison skipped: {e}");
                    note = Some(e.to_string());
                }
            }
        }
    }
    for &n in &opts.direct_sizes {
        let (pos, mass) = plummer_points(n, opts.seed)?;
        let t0 = Instant::now();
        let f = direct(&pos, &mass, 1.0, 0.0);
        let secs = t0.elapsed().as_secs_f64();
        std::hint::black_box(&f);
        let row = NbodyBenchRow {
            method: "direct".into(),
            n,
            seconds: secs,
            evals_per_second: 1.0 / secs,
            accuracy: None,
            setting: "f64, blocked".into(),
            speed_ratio: None,
        };
        print_row(&row);
        rows.push(row);
    }
    Ok(NbodyBenchReport {
        rows,
        threads,
        fmm3d_note: note,
    })
}

/// The FMM row of `pos`/`mass`: the best of `opts.repeats` evaluations, its accuracy on the
/// first `reference.pot.len()` targets; prints its phase profile.
fn fmm_row(
    opts: &NbodyBenchOptions,
    fmm: &Fmm,
    pos: &[[f64; 3]],
    mass: &[f64],
    reference: &Forces,
    threads: usize,
) -> Result<NbodyBenchRow> {
    let n = pos.len();
    let mut best = f64::INFINITY;
    let mut forces = Forces::default();
    let mut stats = FmmStats::default();
    for _ in 0..opts.repeats.max(1) {
        let t0 = Instant::now();
        let (f, st) = fmm.forces(&SourceSet::local(pos, mass), 1.0, 0.0)?;
        let dt = t0.elapsed().as_secs_f64();
        if dt < best {
            best = dt;
            stats = st;
        }
        forces = f;
    }
    print_profile(n, &stats);
    let acc = compare(&subset(&forces, reference.pot.len()), reference);
    Ok(NbodyBenchRow {
        method: "fmm".into(),
        n,
        seconds: best,
        evals_per_second: 1.0 / best,
        accuracy: Some(acc),
        setting: format!(
            "p={} theta={} near field {}, {threads} thread{}",
            opts.params.order,
            opts.params.theta,
            match opts.params.near_field {
                NearField::F32 => "f32",
                NearField::F64 => "f64",
            },
            if threads == 1 { "" } else { "s" }
        ),
        speed_ratio: None,
    })
}

/// The FMM3D rows of `runs` (seconds and forces per precision of `opts.fmm3d_eps`), against
/// our FMM's time and 99th percentile error; marks the matched precision: the fastest run
/// whose p99 error is at most ours (a larger `eps` is not always faster), else the most
/// precise.
fn fmm3d_rows(
    opts: &NbodyBenchOptions,
    n: usize,
    runs: &[Fmm3dRun],
    version: &str,
    reference: &Forces,
    ours_seconds: f64,
    ours_p99: f64,
) -> Vec<NbodyBenchRow> {
    let k = reference.pot.len();
    let accs: Vec<Accuracy> = runs
        .iter()
        .map(|r| compare(&subset(&r.forces, k), reference))
        .collect();
    let eps = &opts.fmm3d_eps;
    let matched = (0..runs.len())
        .filter(|&i| accs[i].acc.p99 <= ours_p99)
        .min_by(|&i, &j| runs[i].seconds.total_cmp(&runs[j].seconds))
        .or_else(|| (0..runs.len()).min_by(|&i, &j| eps[i].total_cmp(&eps[j])));
    runs.iter()
        .enumerate()
        .map(|(i, r)| NbodyBenchRow {
            method: "fmm3d".into(),
            n,
            seconds: r.seconds,
            evals_per_second: 1.0 / r.seconds,
            accuracy: Some(accs[i]),
            setting: format!(
                "fmm3dpy {version} lfmm3d eps={:.0e}, {:.2} cores busy{}",
                eps[i],
                r.cpu_seconds / r.seconds,
                if Some(i) == matched { " (matched)" } else { "" }
            ),
            speed_ratio: Some(ours_seconds / r.seconds),
        })
        .collect()
}

/// Prints the accuracy table: for a Plummer sphere and Gaussian clumps (10 clumps of radius
/// 0.2 in a 10 kpc box) of `n` particles, softening 1e-3, leaf size 32, the 99th percentile
/// (median in parentheses) of `|a - a_direct| / |a_direct|` against direct summation on every
/// particle and the time of one evaluation, for p = 1..6 and theta in {0.4, 0.6, 0.8}.
///
/// Errors: `n` is 0, or the FMM fails.
pub fn accuracy_table(n: u64) -> Result<()> {
    let models = [
        (
            "plummer",
            InitialConditions::Plummer {
                n,
                total_mass: 1.0,
                scale_radius: 1.0,
                max_radius: 30.0,
                seed: 1,
            },
        ),
        (
            "clumps",
            InitialConditions::Clumps {
                n,
                clumps: 10,
                total_mass: 1.0,
                box_size: 10.0,
                clump_radius: 0.2,
                velocity_dispersion: 0.0,
                seed: 2,
            },
        ),
    ];
    let eps = 1e-3;
    for (name, ic) in models {
        let p = ic.generate(1.0, 0, 1, 1.0)?;
        let reference = direct(p.valid_pos(), p.valid_mass(), 1.0, eps);
        println!("\n{name}, N = {n}, eps = {eps}: 99th percentile |a - a_direct|/|a_direct| (median in parentheses), time per evaluation");
        println!("| p | theta = 0.4 | theta = 0.6 | theta = 0.8 |");
        println!("|---|---|---|---|");
        for order in 1..=6 {
            let mut row = format!("| {order} |");
            for theta in [0.4, 0.6, 0.8] {
                let fmm = Fmm::new(FmmParams {
                    order,
                    theta,
                    leaf_size: 32,
                    ..FmmParams::default()
                })?;
                let t0 = Instant::now();
                let (f, _) =
                    fmm.forces(&SourceSet::local(p.valid_pos(), p.valid_mass()), 1.0, eps)?;
                let dt = t0.elapsed().as_secs_f64();
                let acc = compare(&f, &reference);
                row += &format!(
                    " {:.2e} ({:.1e}) {:.0} ms |",
                    acc.acc.p99,
                    acc.acc.p50,
                    dt * 1e3
                );
            }
            println!("{row}");
        }
    }
    Ok(())
}

/// One row of the sharded benchmark (`lockstep bench nbody --ranks 1,2`).
#[derive(Debug, Clone, PartialEq)]
pub struct RanksRow {
    /// Ranks (ThreadComm replicas, each with `threads / ranks` rayon workers).
    pub ranks: usize,
    /// Particles over all ranks.
    pub n: usize,
    /// Seconds per force evaluation (slowest rank, best of the repeats).
    pub seconds: f64,
    /// Force evaluations per second.
    pub evals_per_second: f64,
    /// `t(1 rank) / t(ranks)` with the same total number of worker threads split over the
    /// ranks: the share of the one-rank speed kept by the decomposition (1 = no overhead).
    /// NaN when the list has no one-rank entry before this one.
    pub efficiency: f64,
    /// Bytes sent per step over all ranks (locally essential tree exchange).
    pub bytes_per_step: usize,
    /// Largest rank count over the mean count after redistribution.
    pub imbalance: f64,
}

/// The Plummer sphere of `n` particles the sharded benchmarks share (CPU and GPU ranks).
pub(super) fn ranks_plummer(n: usize) -> InitialConditions {
    InitialConditions::Plummer {
        n: n as u64,
        total_mass: 1.0,
        scale_radius: 1.0,
        max_radius: 30.0,
        seed: 2024,
    }
}

/// Sharded FMM benchmark on ThreadComm ranks: for each entry of `ranks`, a Plummer sphere of
/// `n` particles generated across the ranks, redistributed along the Morton order, then
/// `repeats` timed evaluations of [`sharded_forces`]. The machine's rayon
/// workers are split evenly between the ranks, so the efficiency measures what the
/// decomposition and the exchange cost. Prints a table.
pub fn bench_nbody_ranks(
    ranks: &[usize],
    n: usize,
    params: FmmParams,
    repeats: usize,
) -> Result<Vec<RanksRow>> {
    let fmm = Fmm::new(params)?;
    let threads = rayon::current_num_threads();
    let ic = ranks_plummer(n);
    println!(
        "lockstep bench nbody --ranks: Plummer sphere N = {n}, eps = 1e-3, FMM p = {}, theta = {}, {threads} worker threads split over the ranks",
        params.order, params.theta
    );
    println!(
        "{:>5} {:>9} {:>10} {:>9} {:>10} {:>14} {:>9}",
        "ranks", "N", "s/eval", "evals/s", "efficiency", "bytes/step", "imbalance"
    );
    let mut rows: Vec<RanksRow> = Vec::new();
    for &r in ranks {
        if r == 0 {
            bail!("--ranks: give rank counts >= 1 (got 0)");
        }
        let per_rank = (threads / r).max(1);
        let out = lockstep_comm::run_replicas(r, |comm| -> Result<(f64, usize, f64)> {
            let pool = rayon::ThreadPoolBuilder::new()
                .num_threads(per_rank)
                .build()
                .with_context(|| format!("rayon pool of {per_rank} threads"))?;
            pool.install(|| {
                let mut p = ic.generate(1.0, comm.rank(), r, 1.5)?;
                let st = redistribute(&comm, &mut p)?;
                let mut best = f64::INFINITY;
                let mut bytes = 0usize;
                for _ in 0..repeats.max(1) {
                    comm.barrier()?;
                    let t0 = Instant::now();
                    let (_, fs) = sharded_forces(&comm, &p, &fmm, 1.0, 1e-3)?;
                    let dt = comm.all_reduce_scalar(t0.elapsed().as_secs_f64(), ReduceOp::Max)?;
                    best = best.min(dt);
                    bytes = comm.all_reduce_scalar(fs.bytes_sent as u64, ReduceOp::Sum)? as usize;
                }
                Ok((best, bytes, st.imbalance))
            })
        })
        .map_err(|e| anyhow!("{e}"))?;
        let (secs, bytes, imbalance) = out[0];
        let t1 = rows.iter().find(|x| x.ranks == 1).map(|x| x.seconds);
        let row = RanksRow {
            ranks: r,
            n,
            seconds: secs,
            evals_per_second: 1.0 / secs,
            efficiency: t1
                .map(|t| t / secs)
                .unwrap_or(if r == 1 { 1.0 } else { f64::NAN }),
            bytes_per_step: bytes,
            imbalance,
        };
        println!(
            "{:>5} {:>9} {:>10.4} {:>9.3} {:>10.2} {:>14} {:>9.4}",
            row.ranks,
            row.n,
            row.seconds,
            row.evals_per_second,
            row.efficiency,
            row.bytes_per_step,
            row.imbalance
        );
        rows.push(row);
    }
    Ok(rows)
}
