//! `lockstep bench allreduce`: all-reduce bandwidth of ThreadComm and MpiComm against a
//! single-core memcpy of the same size, measured in the same run.

use anyhow::{bail, Context, Result};
use lockstep_comm::launch::{mpirun_command, run_with_limit};
use lockstep_comm::{run_replicas, CommError, CommExt, Communicator, ReduceOp, World};
use std::time::{Duration, Instant};

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

/// One measured size.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Timing {
    /// Buffer size in bytes (f32 elements x 4).
    pub bytes: usize,
    /// Mean seconds per operation (for collectives: the slowest rank's mean).
    pub seconds: f64,
    /// Operations timed.
    pub reps: usize,
}

impl Timing {
    /// Algorithm bandwidth in GB/s (10^9 bytes per second): `bytes / seconds`.
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.seconds / 1e9
    }
}

/// The benchmark's sizes: 4 KiB to 256 MiB in steps of 4x.
pub fn default_sizes() -> Vec<usize> {
    (0..9).map(|k| 4096usize << (2 * k)).collect()
}

/// Repetitions so that one size takes about `budget_s` seconds, at least 3.
fn reps_for(one: f64, budget_s: f64) -> usize {
    ((budget_s / one.max(1e-9)) as usize).clamp(3, 2000)
}

/// Times an in-place f32 sum all-reduce of each size on `comm` (a collective).
///
/// One warm-up operation per size, then enough repetitions for about `budget_s` seconds
/// (the count is agreed by all ranks); the time is the slowest rank's (MAX).
///
/// Errors: any [`CommError`] of the collectives.
pub fn all_reduce_timings(
    comm: &dyn Communicator,
    sizes: &[usize],
    budget_s: f64,
) -> Result<Vec<Timing>, CommError> {
    let mut out = Vec::with_capacity(sizes.len());
    for &bytes in sizes {
        let mut buf = vec![1.0f32; bytes / 4];
        comm.barrier()?;
        let t = Instant::now();
        comm.all_reduce(&mut buf, ReduceOp::Sum)?;
        let one = comm.all_reduce_scalar(t.elapsed().as_secs_f64(), ReduceOp::Max)?;
        let reps = reps_for(one, budget_s);
        comm.barrier()?;
        let t = Instant::now();
        for _ in 0..reps {
            comm.all_reduce(&mut buf, ReduceOp::Sum)?;
            // Keep values bounded (and the data live) without extra passes over the buffer.
            buf[0] = 1.0;
        }
        let total = comm.all_reduce_scalar(t.elapsed().as_secs_f64(), ReduceOp::Max)?;
        out.push(Timing {
            bytes,
            seconds: total / reps as f64,
            reps,
        });
    }
    Ok(out)
}

/// Times a single-core `memcpy` (`copy_from_slice`) of `bytes` bytes between two buffers.
pub fn memcpy_timing(bytes: usize, budget_s: f64) -> Timing {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let t = Instant::now();
    dst.copy_from_slice(&src);
    let reps = reps_for(t.elapsed().as_secs_f64(), budget_s);
    let t = Instant::now();
    for i in 0..reps {
        dst.copy_from_slice(&src);
        std::hint::black_box(&mut dst)[i % bytes] ^= 1;
    }
    Timing {
        bytes,
        seconds: t.elapsed().as_secs_f64() / reps as f64,
        reps,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_comm::SelfComm;

    #[test]
    fn sizes_span_4k_to_256m() {
        let s = default_sizes();
        assert_eq!(s.first(), Some(&4096));
        assert_eq!(s.last(), Some(&(256 << 20)));
    }

    #[test]
    fn timings_are_positive() {
        let t = all_reduce_timings(&SelfComm, &[4096], 0.001).unwrap();
        assert!(t[0].seconds > 0.0 && t[0].reps >= 3);
        assert!(memcpy_timing(1 << 16, 0.001).gbps() > 0.0);
    }
}
