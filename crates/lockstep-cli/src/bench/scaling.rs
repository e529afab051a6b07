//! `lockstep bench scaling CONFIG`: optimizer updates per second and samples per second with
//! 1 replica (local batch B) and with N replicas (local batch B each), for threads and for
//! MPI, in one invocation. Each replica computes on one core; the first updates are warm-up;
//! the figures are medians over the timed updates (each update timed on the slowest rank),
//! with the range of the per-round ratios (each round against its own 1-replica run) and
//! each run's spread between rounds, so that drift in the machine's speed shows. The
//! machine's own bound for N replicas is measured in the same rounds: N 1-replica processes
//! at once that never communicate (`independent`), so the table separates what the machine
//! loses when N cores are busy (shared caches, memory bandwidth, clock) from what the
//! replicas lose to communication and waiting.
//! The weights are held fixed (SGD with a vanishing learning rate) so that all runs simulate
//! the same network: training would change the firing, and with it the cost of a sample.

use crate::train::{prepare, Overrides};
use anyhow::{bail, Context, Result};
use lockstep_comm::World;
use lockstep_snn::{PoissonTrials, SnnReplica};
use lockstep_train::job::run_job;
use lockstep_train::EngineOptions;
use serde_json::{json, Value};
use std::path::PathBuf;
use std::time::Duration;

/// Options of `lockstep bench scaling`.
#[derive(Debug, clap::Args)]
pub struct ScalingArgs {
    /// A training config; its run.batch_size is the local batch B of every replica.
    pub config: PathBuf,
    /// Replicas N of the parallel runs.
    #[arg(allow_negative_numbers = true, long, default_value_t = 2)]
    pub replicas: usize,
    /// Timed updates per run (the median is reported).
    #[arg(allow_negative_numbers = true, long, default_value_t = 10)]
    pub updates: u64,
    /// Warm-up updates per run (not timed).
    #[arg(allow_negative_numbers = true, long, default_value_t = 2)]
    pub warmup: u64,
    /// Rounds: the 1-replica, thread and MPI runs are repeated in turn this many times and
    /// the medians taken over all rounds, so drift in the machine's speed hits all alike.
    #[arg(allow_negative_numbers = true, long, default_value_t = 3)]
    pub rounds: usize,
    /// Skip the MPI runs.
    #[arg(long)]
    pub no_mpi: bool,
    /// Skip the thread runs.
    #[arg(long)]
    pub no_threads: bool,
    /// Skip the machine-bound runs (N independent 1-replica processes at once).
    #[arg(long)]
    pub no_independent: bool,
    /// Internal: one rank of the MPI measurement.
    #[arg(long, hide = true)]
    pub mpi_worker: bool,
    /// Internal: one of the independent 1-replica processes.
    #[arg(long, hide = true)]
    pub independent_worker: bool,
}

/// Seconds of the timed updates (slowest rank): whole update, communication, compute.
#[derive(Debug, Clone, Default, serde::Serialize, serde::Deserialize)]
struct Measured {
    replicas: usize,
    global_batch: usize,
    step_s: Vec<f64>,
    comm_s: Vec<f64>,
    compute_s: Vec<f64>,
    #[serde(default)]
    data_s: Vec<f64>,
}

impl Measured {
    fn add(&mut self, other: Measured) {
        self.replicas = other.replicas;
        self.global_batch = other.global_batch;
        self.step_s.extend(other.step_s);
        self.comm_s.extend(other.comm_s);
        self.compute_s.extend(other.compute_s);
        self.data_s.extend(other.data_s);
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

/// Median of each round's `per_round` consecutive update times.
fn round_medians(step_s: &[f64], per_round: usize) -> Vec<f64> {
    step_s
        .chunks(per_round.max(1))
        .map(|c| median(c.to_vec()))
        .collect()
}

/// Smallest and largest throughput ratio of a run to the 1-replica baseline, pairing each
/// round's median update time (s) with the same round's baseline; global batches in samples.
/// NaN when there are no rounds.
fn paired_ratio_range(
    rounds: &[f64],
    global_batch: usize,
    baseline: &[f64],
    baseline_batch: usize,
) -> (f64, f64) {
    let ratios = rounds
        .iter()
        .zip(baseline)
        .map(|(&s, &b)| (global_batch as f64 / s) / (baseline_batch as f64 / b));
    ratios.fold((f64::NAN, f64::NAN), |(lo, hi), r| (lo.min(r), hi.max(r)))
}

/// Slowest over fastest of the rounds' median update times (1 = no drift between rounds).
fn spread(rounds: &[f64]) -> f64 {
    let lo = rounds.iter().copied().fold(f64::NAN, f64::min);
    let hi = rounds.iter().copied().fold(f64::NAN, f64::max);
    hi / lo
}

fn measure(
    world: &World,
    args: &ScalingArgs,
    distribution: Value,
    tmp: &std::path::Path,
    tag: &str,
) -> Result<Measured> {
    let overrides = Overrides {
        updates: Some(args.warmup + args.updates),
        output_dir: Some(tmp.join(tag)),
        overwrite: true,
        distribution: Some(distribution),
        checkpoint_every: Some(0),
        // The weights stay as they are (SGD with a vanishing step), so every run simulates the
        // same network and the cost per sample does not drift with the training.
        optimizer: Some(json!({"name": "sgd", "learning_rate": 1e-30})),
    };
    let (json, cfg) = prepare(&args.config, &overrides)?;
    let opts = EngineOptions {
        resolved_config: json,
        quiet: true,
        ..EngineOptions::default()
    };
    let config = args.config.clone();
    let s = run_job(world, &cfg, &opts, |_rank| {
        Ok((SnnReplica::from_config(&config, false)?, PoissonTrials))
    })?;
    let timed = &s.update_times[args.warmup as usize..];
    let replicas = match &cfg.distribution {
        None => 1,
        Some(d) => d.devices.as_ref().map_or(world.comm().size(), Vec::len),
    };
    Ok(Measured {
        replicas,
        global_batch: cfg.batch_size * replicas,
        step_s: timed.iter().map(|t| t[3]).collect(),
        comm_s: timed.iter().map(|t| t[2]).collect(),
        compute_s: timed.iter().map(|t| t[1]).collect(),
        data_s: timed.iter().map(|t| t[0]).collect(),
    })
}

/// Combines `runs` that ran at the same time without communicating into one N-replica
/// measurement: update `i` takes the slowest run's update `i` (as a synchronized update
/// waits for the slowest replica), with no communication.
fn combine_concurrent(runs: &[Measured]) -> Measured {
    let k = runs.iter().map(|m| m.step_s.len()).min().unwrap_or(0);
    let slowest = |f: fn(&Measured) -> &Vec<f64>| -> Vec<f64> {
        (0..k)
            .map(|i| runs.iter().map(|m| f(m)[i]).fold(f64::NAN, f64::max))
            .collect()
    };
    Measured {
        replicas: runs.len(),
        global_batch: runs.iter().map(|m| m.global_batch).sum(),
        step_s: slowest(|m| &m.step_s),
        comm_s: vec![0.0; k],
        compute_s: slowest(|m| &m.compute_s),
        data_s: slowest(|m| &m.data_s),
    }
}

/// The machine's bound for N replicas: N 1-replica runs of the config at once, as separate
/// processes that never communicate (each on one core, like a replica).
fn measure_independent(args: &ScalingArgs, n: usize) -> Result<Measured> {
    let (updates, warmup) = (args.updates.to_string(), args.warmup.to_string());
    let config = args.config.as_os_str();
    let worker_args: [&std::ffi::OsStr; 8] = [
        "bench".as_ref(),
        "scaling".as_ref(),
        config,
        "--updates".as_ref(),
        updates.as_ref(),
        "--warmup".as_ref(),
        warmup.as_ref(),
        "--independent-worker".as_ref(),
    ];
    let runs: Vec<Measured> =
        super::mpi_worker::run_concurrent_workers(n, &worker_args, Duration::from_secs(3600))?;
    Ok(combine_concurrent(&runs))
}

/// Prints the scaling table of the measured runs (1 replica, the independent bound, thread
/// and MPI replicas, as `args` asked), each against 1 replica, and the bound's lines.
fn print_table(
    args: &ScalingArgs,
    one: &Measured,
    bound: &Measured,
    threads: &Measured,
    mpi: &Measured,
) {
    let n = args.replicas;
    let mut rows = vec![("1 replica", one)];
    if !args.no_independent {
        rows.push(("independent", bound));
    }
    if !args.no_threads {
        rows.push(("threads", threads));
    }
    if !args.no_mpi {
        rows.push(("mpi", mpi));
    }
    let one_sps = one.global_batch as f64 / median(one.step_s.clone());
    let per_round = args.updates as usize;
    let one_rounds = round_medians(&one.step_s, per_round);
    println!(
        "local batch {} per replica, median of {} rounds x {} updates (after {} warm-up each), one core per replica",
        one.global_batch, args.rounds.max(1), args.updates, args.warmup
    );
    println!(
        "{:>11} {:>8} {:>12} {:>12} {:>12} {:>8} {:>9} {:>9} {:>8} {:>8} {:>8} {:>10}",
        "run",
        "replicas",
        "global batch",
        "updates/s",
        "samples/s",
        "ratio",
        "ratio min",
        "ratio max",
        "spread",
        "data %",
        "comm %",
        "compute s"
    );
    for (name, m) in &rows {
        let step = median(m.step_s.clone());
        let ups = 1.0 / step;
        let sps = m.global_batch as f64 / step;
        let ratio = sps / one_sps;
        let rounds = round_medians(&m.step_s, per_round);
        let (lo, hi) = paired_ratio_range(&rounds, m.global_batch, &one_rounds, one.global_batch);
        println!(
            "{:>11} {:>8} {:>12} {:>12.4} {:>12.2} {:>8.3} {:>9.3} {:>9.3} {:>8.3} {:>8.2} {:>8.2} {:>10.4}",
            name,
            m.replicas,
            m.global_batch,
            ups,
            sps,
            ratio,
            lo,
            hi,
            spread(&rounds),
            100.0 * median(m.data_s.clone()) / step,
            100.0 * median(m.comm_s.clone()) / step,
            median(m.compute_s.clone())
        );
    }
    println!("ratio = samples/s of the run / samples/s of 1 replica (same local batch); ratio min/max: the same per round, against that round's 1-replica run; spread = slowest / fastest round (median update time); data, comm and compute are each the slowest rank's (data: the chief drawing the global batch and the scatter; comm: the gradient all-reduce, including the wait for the slower replica)");
    if !args.no_independent {
        let bound_sps = bound.global_batch as f64 / median(bound.step_s.clone());
        println!(
            "independent = {n} 1-replica processes at once that never communicate, each update the slowest of the {n}: the machine's bound for {n} replicas ({:.3}x)",
            bound_sps / one_sps
        );
        for (name, m) in rows.iter().filter(|(r, _)| *r == "threads" || *r == "mpi") {
            let sps = m.global_batch as f64 / median(m.step_s.clone());
            println!(
                "{name}: {:.1}% of the bound ({:.3}x of {:.3}x)",
                100.0 * sps / bound_sps,
                sps / one_sps,
                bound_sps / one_sps
            );
        }
    }
}

/// Runs the benchmark and prints the table.
pub fn run(args: &ScalingArgs, world: &World) -> Result<()> {
    if args.updates == 0 {
        bail!("--updates must be at least 1");
    }
    let tmp = tempfile::tempdir().context("cannot create a temporary folder")?;
    if args.mpi_worker {
        let m = measure(world, args, json!({"strategy": "mpi"}), tmp.path(), "mpi")?;
        if world.comm().is_chief() {
            println!("{}", serde_json::to_string(&m)?);
        }
        return Ok(());
    }
    if args.independent_worker {
        let m = measure(world, args, Value::Null, tmp.path(), "serial")?;
        println!("{}", serde_json::to_string(&m)?);
        return Ok(());
    }
    if world.comm().size() > 1 {
        bail!("run `lockstep bench scaling` without mpirun: it starts its own MPI jobs");
    }
    let n = args.replicas;
    let (mut one, mut bound, mut threads, mut mpi) = (
        Measured::default(),
        Measured::default(),
        Measured::default(),
        Measured::default(),
    );
    for round in 1..=args.rounds.max(1) {
        eprintln!("round {round}: 1 replica ...");
        one.add(measure(world, args, Value::Null, tmp.path(), "serial")?);
        if !args.no_independent {
            eprintln!("round {round}: {n} independent 1-replica processes at once ...");
            bound.add(measure_independent(args, n)?);
        }
        if !args.no_threads {
            eprintln!("round {round}: {n} thread replicas ...");
            let devices: Vec<String> = (0..n).map(|r| format!("cpu:{r}")).collect();
            threads.add(measure(
                world,
                args,
                json!({"strategy": "threads", "devices": devices}),
                tmp.path(),
                "threads",
            )?);
        }
        if !args.no_mpi {
            eprintln!("round {round}: {n} MPI replicas (mpirun -n {n}) ...");
            let (updates, warmup) = (args.updates.to_string(), args.warmup.to_string());
            let worker_args: [&std::ffi::OsStr; 8] = [
                "bench".as_ref(),
                "scaling".as_ref(),
                args.config.as_os_str(),
                "--updates".as_ref(),
                updates.as_ref(),
                "--warmup".as_ref(),
                warmup.as_ref(),
                "--mpi-worker".as_ref(),
            ];
            mpi.add(super::mpi_worker::run_mpi_worker(
                n,
                worker_args,
                Duration::from_secs(3600),
            )?);
        }
    }
    print_table(args, &one, &bound, &threads, &mpi);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rounds_are_paired_with_the_baseline_of_the_same_round() {
        // Two rounds of two updates: the baseline (batch 16) slowed down in round 2, and so
        // did the 2-replica run (batch 32).
        let one = round_medians(&[1.0, 1.0, 2.0, 2.0], 2);
        let two = round_medians(&[1.0, 1.2, 2.0, 2.0], 2);
        assert_eq!(one, vec![1.0, 2.0]);
        assert_eq!(two, vec![1.1, 2.0]);
        let (lo, hi) = paired_ratio_range(&two, 32, &one, 16);
        assert!(
            (lo - 2.0 / 1.1).abs() < 1e-12 && (hi - 2.0).abs() < 1e-12,
            "{lo} {hi}"
        );
        assert!((spread(&one) - 2.0).abs() < 1e-12);
        assert!(paired_ratio_range(&[], 32, &[], 16).0.is_nan());
    }

    #[test]
    fn concurrent_runs_combine_into_the_slowest_update_and_the_summed_batch() {
        let run = |step_s: Vec<f64>| Measured {
            replicas: 1,
            global_batch: 16,
            compute_s: step_s.iter().map(|s| s * 0.9).collect(),
            comm_s: vec![0.0; step_s.len()],
            data_s: vec![0.0; step_s.len()],
            step_s,
        };
        let m = combine_concurrent(&[run(vec![1.0, 3.0, 2.0]), run(vec![2.0, 1.0])]);
        assert_eq!((m.replicas, m.global_batch), (2, 32));
        // Update i waits for the slower process; the extra update of the first is dropped.
        assert_eq!(m.step_s, vec![2.0, 3.0]);
        assert_eq!(m.compute_s, vec![1.8, 2.7]);
        assert_eq!(m.comm_s, vec![0.0, 0.0]);
    }
}
