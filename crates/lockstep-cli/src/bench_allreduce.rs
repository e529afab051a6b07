//! `lockstep bench allreduce`: all-reduce bandwidth of ThreadComm and MpiComm against a
//! single-core memcpy of the same size, measured in the same run.

use anyhow::{bail, Context, Result};
use lockstep_comm::bench::{all_reduce_timings, default_sizes, memcpy_timing, Timing};
use lockstep_comm::launch::mpirun_command;
use lockstep_comm::run_replicas;
use lockstep_comm::testing::run_with_limit;
use lockstep_comm::World;
use std::time::Duration;

/// Options of `lockstep bench allreduce`.
#[derive(Debug, clap::Args)]
pub struct AllreduceArgs {
    /// Ranks (threads and MPI processes).
    #[arg(long, default_value_t = 2)]
    pub ranks: usize,
    /// Largest size in MiB (sizes run from 4 KiB up in steps of 4x).
    #[arg(long, default_value_t = 256)]
    pub max_mib: usize,
    /// Seconds spent on each size and backend.
    #[arg(long, default_value_t = 0.3)]
    pub seconds: f64,
    /// Skip the MPI measurement.
    #[arg(long)]
    pub no_mpi: bool,
    /// Internal: run as one rank of the MPI measurement and print JSON timings on the chief.
    #[arg(long, hide = true)]
    pub mpi_worker: bool,
}

fn sizes(max_mib: usize) -> Vec<usize> {
    default_sizes()
        .into_iter()
        .filter(|&b| b <= max_mib << 20)
        .collect()
}

/// Runs the benchmark and prints the table.
pub fn run(args: &AllreduceArgs, world: &World) -> Result<()> {
    let sizes = sizes(args.max_mib);
    if args.mpi_worker {
        let t = all_reduce_timings(world.comm(), &sizes, args.seconds)?;
        if world.comm().is_chief() {
            println!("{}", serde_json::to_string(&t)?);
        }
        return Ok(());
    }
    if world.comm().size() > 1 {
        bail!("run `lockstep bench allreduce` without mpirun: it starts its own MPI job");
    }
    eprintln!(
        "measuring memcpy and ThreadComm with {} ranks ...",
        args.ranks
    );
    let memcpy: Vec<Timing> = sizes
        .iter()
        .map(|&b| memcpy_timing(b, args.seconds))
        .collect();
    let threads = run_replicas(args.ranks, |comm| {
        all_reduce_timings(&comm, &sizes, args.seconds)
    })
    .map_err(|f| anyhow::anyhow!("{f}"))?
    .remove(0);
    let mpi = if args.no_mpi {
        None
    } else {
        eprintln!("measuring MpiComm with mpirun -n {} ...", args.ranks);
        let exe = std::env::current_exe().context("cannot locate the lockstep executable")?;
        let mut cmd = mpirun_command(args.ranks);
        cmd.arg(exe)
            .args(["bench", "allreduce", "--mpi-worker"])
            .args(["--max-mib", &args.max_mib.to_string()])
            .args(["--seconds", &args.seconds.to_string()]);
        let out = run_with_limit(cmd, Duration::from_secs(600)).map_err(anyhow::Error::msg)?;
        if !out.success() {
            bail!("the MPI measurement failed:\n{}", out.all_output());
        }
        let line = out
            .stdout
            .lines()
            .rfind(|l| l.starts_with('['))
            .context("the MPI measurement printed no timings")?;
        Some(serde_json::from_str::<Vec<Timing>>(line)?)
    };
    println!(
        "all-reduce (f32 sum, in place), {} ranks; GB/s = bytes / time; ratio = all-reduce GB/s / single-core memcpy GB/s",
        args.ranks
    );
    println!(
        "{:>10} {:>12} {:>14} {:>8} {:>14} {:>8}",
        "size", "memcpy GB/s", "threads GB/s", "ratio", "mpi GB/s", "ratio"
    );
    for (i, m) in memcpy.iter().enumerate() {
        let t = &threads[i];
        let (mg, mr) = match &mpi {
            Some(v) => (
                format!("{:.2}", v[i].gbps()),
                format!("{:.2}", v[i].gbps() / m.gbps()),
            ),
            None => ("-".into(), "-".into()),
        };
        println!(
            "{:>10} {:>12.2} {:>14.2} {:>8.2} {:>14} {:>8}",
            human(m.bytes),
            m.gbps(),
            t.gbps(),
            t.gbps() / m.gbps(),
            mg,
            mr
        );
    }
    Ok(())
}

fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}
