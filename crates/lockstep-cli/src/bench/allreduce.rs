//! `lockstep bench allreduce`: all-reduce time and bandwidth of ThreadComm and MpiComm, next
//! to Open MPI's own `MPI_Allreduce` of the same message (the bound for MpiComm) and a
//! single-core memcpy of the same size (the yardstick for bandwidth), all measured in the
//! same run. ThreadComm's bound is a memcpy of the same size on every rank at once: each
//! rank reduces its `1/ranks` share of the message, reading it from every rank's buffer and
//! writing it back into every one, so with 2 ranks each core reads and writes as many bytes
//! as one memcpy of the message, and the cores share the memory bandwidth.
//!
//! Every figure is the median over several samples; each sample times enough back-to-back
//! operations to last a few milliseconds (on the slowest rank), on buffers written once
//! before timing and warmed by one untimed operation. Buffers start on a page boundary: a
//! copy whose destination lies a few bytes past its source modulo 4 KiB (two heap blocks in
//! a row) runs up to 20 times slower (4K aliasing of loads and stores), which is what made
//! the memcpy yardstick read 2.6 GB/s at 64-256 KiB against 30 GB/s at 1 MiB.

use anyhow::{bail, Result};
use lockstep_comm::{run_replicas, CommError, CommExt, Communicator, ReduceOp, World};
use std::time::{Duration, Instant};

/// Options of `lockstep bench allreduce`.
#[derive(Debug, clap::Args)]
pub struct AllreduceArgs {
    /// Ranks (threads and MPI processes).
    #[arg(allow_negative_numbers = true, long, default_value_t = 2)]
    pub ranks: usize,
    /// Largest size in MiB (sizes run from 16 bytes up in steps of 4x).
    #[arg(allow_negative_numbers = true, long, default_value_t = 256)]
    pub max_mib: usize,
    /// Seconds spent on each size and measurement (split over the samples).
    #[arg(allow_negative_numbers = true, long, default_value_t = 0.3)]
    pub seconds: f64,
    /// Timed samples per size and measurement (the median is reported).
    #[arg(allow_negative_numbers = true, long, default_value_t = 7)]
    pub samples: usize,
    /// Skip the MPI measurements.
    #[arg(long)]
    pub no_mpi: bool,
    /// Internal: run as one rank of the MPI measurement and print JSON timings on the chief.
    #[arg(long, hide = true)]
    pub mpi_worker: bool,
}

/// One measured size.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Timing {
    /// Buffer size in bytes (f32 elements x 4).
    pub bytes: usize,
    /// Median over the samples of the seconds per operation (for collectives each sample is
    /// the slowest rank's).
    pub seconds: f64,
    /// Fastest sample's seconds per operation.
    pub best_seconds: f64,
    /// Operations per sample.
    pub ops: usize,
    /// Samples taken.
    pub samples: usize,
}

impl Timing {
    /// Algorithm bandwidth in GB/s (10^9 bytes per second) of the median: `bytes / seconds`.
    pub fn gbps(&self) -> f64 {
        self.bytes as f64 / self.seconds / 1e9
    }

    /// Median microseconds per operation.
    pub fn micros(&self) -> f64 {
        self.seconds * 1e6
    }
}

/// The timings of the MPI worker: MpiComm and the raw in-place `MPI_Allreduce`.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct MpiTimings {
    mpi_comm: Vec<Timing>,
    mpi_allreduce: Vec<Timing>,
}

/// The benchmark's sizes: 16 bytes to 256 MiB in steps of 4x.
pub fn default_sizes() -> Vec<usize> {
    (0..13).map(|k| 16usize << (2 * k)).collect()
}

fn sizes(max_mib: usize) -> Vec<usize> {
    default_sizes()
        .into_iter()
        .filter(|&b| b <= max_mib << 20)
        .collect()
}

/// Operations per sample so that `samples` samples take about `budget_s` seconds, given
/// that one operation took `one` seconds; at least 1.
fn ops_per_sample(one: f64, budget_s: f64, samples: usize) -> usize {
    let per_sample = budget_s / samples.max(1) as f64;
    ((per_sample / one.max(1e-9)) as usize).clamp(1, 1_000_000)
}

/// A zeroed buffer of `len` elements that starts on a 4 KiB page boundary, every page written;
/// returns the storage and the offset of the aligned start.
fn page_aligned<T: Copy + Default>(len: usize) -> (Vec<T>, usize) {
    let pad = 4096 / std::mem::size_of::<T>();
    let mut v = vec![T::default(); len + pad];
    v.fill(T::default());
    let off = v.as_ptr().align_offset(4096).min(pad);
    std::hint::black_box(&mut v);
    (v, off)
}

/// Median and minimum of per-sample seconds, divided by the operations per sample.
fn summarize(bytes: usize, sample_s: &mut [f64], ops: usize) -> Timing {
    sample_s.sort_by(f64::total_cmp);
    let mid = sample_s.len() / 2;
    let median = if sample_s.len() % 2 == 1 {
        sample_s[mid]
    } else {
        0.5 * (sample_s[mid - 1] + sample_s[mid])
    };
    Timing {
        bytes,
        seconds: median / ops as f64,
        best_seconds: sample_s[0] / ops as f64,
        ops,
        samples: sample_s.len(),
    }
}

/// An operation on a buffer `buf` with a source `src` of the same size.
type OpFn<'a> = dyn Fn(&mut [f32], &[f32]) -> Result<(), CommError> + 'a;

/// One operation to time on a buffer: `run(buf, src)` (`src`: a second buffer of the same
/// size, for the memcpy), on every rank or on the chief only (the others then only meet it
/// at the barriers).
struct Op<'a> {
    run: &'a OpFn<'a>,
    chief_only: bool,
    /// Whether `run` reads `src` (a second buffer is then allocated where it runs).
    reads_src: bool,
}

/// Times each of `ops` for each size on `comm` (a collective: call it on every rank), with
/// the samples of the different ops interleaved, so that a change in the machine's speed
/// during the run hits all of them alike.
///
/// Per size: page-aligned buffers are written, each op is warmed by one untimed run and
/// timed once (the slowest rank's) to set its operations per sample; then `samples` rounds
/// take one sample of each op in turn, each the slowest rank's time. Returns one timing list
/// per op.
///
/// Errors: any [`CommError`] of the collectives or of an op.
fn interleaved_timings(
    comm: &dyn Communicator,
    sizes: &[usize],
    budget_s: f64,
    samples: usize,
    ops: &[Op<'_>],
) -> Result<Vec<Vec<Timing>>, CommError> {
    let mut out = vec![Vec::with_capacity(sizes.len()); ops.len()];
    for &bytes in sizes {
        let n = bytes / 4;
        // Zeros: sums stay zero (no overflow to infinity).
        let (mut storage, off) = page_aligned::<f32>(n);
        let buf = &mut storage[off..off + n];
        let needs_src = ops
            .iter()
            .any(|o| o.reads_src && (!o.chief_only || comm.is_chief()));
        let m = if needs_src { n } else { 0 };
        let (src_storage, src_off) = page_aligned::<f32>(m);
        let src = &src_storage[src_off..src_off + m];
        let runs_here = |op: &Op<'_>| !op.chief_only || comm.is_chief();
        let mut counts = Vec::with_capacity(ops.len());
        for op in ops {
            if runs_here(op) {
                (op.run)(buf, src)?;
            }
            comm.barrier()?;
            let t = Instant::now();
            if runs_here(op) {
                (op.run)(buf, src)?;
            }
            let one = comm.all_reduce_scalar(t.elapsed().as_secs_f64(), ReduceOp::Max)?;
            counts.push(ops_per_sample(one, budget_s, samples));
        }
        let mut sample_s = vec![Vec::with_capacity(samples); ops.len()];
        for _ in 0..samples.max(1) {
            for (k, op) in ops.iter().enumerate() {
                comm.barrier()?;
                let t = Instant::now();
                if runs_here(op) {
                    for _ in 0..counts[k] {
                        (op.run)(std::hint::black_box(&mut *buf), std::hint::black_box(src))?;
                    }
                }
                let s = t.elapsed().as_secs_f64();
                sample_s[k].push(comm.all_reduce_scalar(s, ReduceOp::Max)?);
            }
        }
        for (k, s) in sample_s.iter_mut().enumerate() {
            out[k].push(summarize(bytes, s, counts[k]));
        }
    }
    Ok(out)
}

/// The in-place f32 sum all-reduce through a [`Communicator`].
fn comm_all_reduce<'a>(
    comm: &'a dyn Communicator,
) -> impl Fn(&mut [f32], &[f32]) -> Result<(), CommError> + 'a {
    move |buf, _| comm.all_reduce(buf, ReduceOp::Sum)
}

/// A single-core memcpy (`copy_from_slice`) of `src` into `buf`.
fn memcpy(buf: &mut [f32], src: &[f32]) -> Result<(), CommError> {
    buf.copy_from_slice(src);
    Ok(())
}

/// Open MPI's own in-place `MPI_Allreduce` (f32, `MPI_SUM`, `MPI_COMM_WORLD`) called
/// directly through the raw bindings: the bound for MpiComm.
///
/// Errors: a count beyond C `int`, or a non-zero MPI return code.
#[cfg(feature = "mpi")]
fn raw_mpi_all_reduce(buf: &mut [f32], _src: &[f32]) -> Result<(), CommError> {
    use mpi::collective::SystemOperation;
    use mpi::datatype::Equivalence;
    use mpi::raw::AsRaw;
    let count = std::ffi::c_int::try_from(buf.len())
        .map_err(|_| CommError::Setup(format!("{} elements exceed MPI's int count", buf.len())))?;
    // SAFETY: MPI is initialised on this thread (the worker's world communicator is an
    // MpiComm); `buf` is a live, exclusively borrowed f32 buffer of `count` elements, reduced
    // in place by the blocking call; RSMPI_COMM_WORLD is a constant handle set at load time.
    let code = unsafe {
        mpi::ffi::MPI_Allreduce(
            lockstep_comm::mpi_in_place(),
            buf.as_mut_ptr().cast(),
            count,
            f32::equivalent_datatype().as_raw(),
            SystemOperation::sum().as_raw(),
            mpi::ffi::RSMPI_COMM_WORLD,
        )
    };
    if code != 0 {
        return Err(CommError::Setup(format!(
            "MPI_Allreduce returned error code {code}"
        )));
    }
    Ok(())
}

#[cfg(not(feature = "mpi"))]
fn raw_mpi_all_reduce(_buf: &mut [f32], _src: &[f32]) -> Result<(), CommError> {
    Err(CommError::Setup(
        "this lockstep was built without the `mpi` feature".into(),
    ))
}

/// Runs the benchmark and prints the table.
pub fn run(args: &AllreduceArgs, world: &World) -> Result<()> {
    let sizes = sizes(args.max_mib);
    if args.samples == 0 {
        bail!("--samples must be at least 1");
    }
    if args.mpi_worker {
        let comm = world.comm();
        let through_comm = comm_all_reduce(comm);
        let mut t = interleaved_timings(
            comm,
            &sizes,
            args.seconds,
            args.samples,
            &[
                Op {
                    run: &through_comm,
                    chief_only: false,
                    reads_src: false,
                },
                Op {
                    run: &raw_mpi_all_reduce,
                    chief_only: false,
                    reads_src: false,
                },
            ],
        )?;
        let timings = MpiTimings {
            mpi_allreduce: t.pop().expect("two timing lists"),
            mpi_comm: t.pop().expect("two timing lists"),
        };
        if comm.is_chief() {
            println!("{}", serde_json::to_string(&timings)?);
        }
        return Ok(());
    }
    if world.comm().size() > 1 {
        bail!("run `lockstep bench allreduce` without mpirun: it starts its own MPI job");
    }
    eprintln!(
        "measuring a memcpy (on rank 0) and ThreadComm with {} ranks ...",
        args.ranks
    );
    let mut chief = run_replicas(args.ranks, |comm| {
        let through_comm = comm_all_reduce(&comm);
        interleaved_timings(
            &comm,
            &sizes,
            args.seconds,
            args.samples,
            &[
                Op {
                    run: &memcpy,
                    chief_only: true,
                    reads_src: true,
                },
                Op {
                    run: &memcpy,
                    chief_only: false,
                    reads_src: true,
                },
                Op {
                    run: &through_comm,
                    chief_only: false,
                    reads_src: false,
                },
            ],
        )
    })
    .map_err(|f| anyhow::anyhow!("{f}"))?
    .remove(0);
    let threads = chief.pop().expect("three timing lists");
    let memcpy_all = chief.pop().expect("three timing lists");
    let memcpy = chief.pop().expect("three timing lists");
    let mpi = if args.no_mpi {
        None
    } else {
        eprintln!(
            "measuring MpiComm and MPI_Allreduce with mpirun -n {} ...",
            args.ranks
        );
        let (max_mib, seconds, samples) = (
            args.max_mib.to_string(),
            args.seconds.to_string(),
            args.samples.to_string(),
        );
        Some(super::mpi_worker::run_mpi_worker::<MpiTimings, _, _>(
            args.ranks,
            [
                "bench",
                "allreduce",
                "--mpi-worker",
                "--max-mib",
                &max_mib,
                "--seconds",
                &seconds,
                "--samples",
                &samples,
            ],
            Duration::from_secs(600),
        )?)
    };
    print_table(args, &memcpy, &memcpy_all, &threads, mpi.as_ref());
    Ok(())
}

/// Smallest message for which the all-ranks memcpy bounds ThreadComm: below it the
/// all-reduce's two buffers (2 x the message) may stay in the caches while the memcpys' (2 x
/// the message per rank) do not, or the time is the synchronisation's, not the copy's.
const BOUND_FROM: usize = 64 << 20;

fn print_table(
    args: &AllreduceArgs,
    memcpy: &[Timing],
    memcpy_all: &[Timing],
    threads: &[Timing],
    mpi: Option<&MpiTimings>,
) {
    println!(
        "all-reduce (f32 sum, in place), {} ranks; median of {} samples; GB/s = bytes / time; \
         /memcpy = GB/s over a single-core memcpy's; /MPI = time over MPI_Allreduce's; \
         /bound = time over a memcpy of the message on every rank at once (ThreadComm's bound \
         where the buffers exceed the caches; shown from {} MiB)",
        args.ranks,
        args.samples,
        BOUND_FROM >> 20
    );
    println!(
        "{:>9} {:>7} {:>8} | {:>9} {:>6} {:>7} {:>5} {:>6} | {:>9} {:>6} {:>7} {:>5} | {:>9} {:>6} {:>7}",
        "", "memcpy", "all", "ThreadComm", "", "", "", "", "MpiComm", "", "", "", "MPI_Allreduce", "", ""
    );
    println!(
        "{:>9} {:>7} {:>8} | {:>9} {:>6} {:>7} {:>5} {:>6} | {:>9} {:>6} {:>7} {:>5} | {:>9} {:>6} {:>7}",
        "size",
        "GB/s",
        "us",
        "us",
        "GB/s",
        "/memcpy",
        "/MPI",
        "/bound",
        "us",
        "GB/s",
        "/memcpy",
        "/MPI",
        "us",
        "GB/s",
        "/memcpy"
    );
    for (i, m) in memcpy.iter().enumerate() {
        let t = &threads[i];
        let rel = |x: &Timing| format!("{:.2}", x.gbps() / m.gbps());
        let (mc, raw) = match mpi {
            Some(v) => (Some(&v.mpi_comm[i]), Some(&v.mpi_allreduce[i])),
            None => (None, None),
        };
        let vs_raw = |x: &Timing| match raw {
            Some(r) => format!("{:.2}", x.seconds / r.seconds),
            None => "-".into(),
        };
        let cols = |x: Option<&Timing>| match x {
            Some(x) => (
                format!("{:.1}", x.micros()),
                format!("{:.2}", x.gbps()),
                rel(x),
            ),
            None => ("-".into(), "-".into(), "-".into()),
        };
        let (tu, tg, tr) = cols(Some(t));
        let (mu, mg, mr) = cols(mc);
        let (ru, rg, rr) = cols(raw);
        let all = &memcpy_all[i];
        println!(
            "{:>9} {:>7.2} {:>8.1} | {:>9} {:>6} {:>7} {:>5} {:>6} | {:>9} {:>6} {:>7} {:>5} | {:>9} {:>6} {:>7}",
            human(m.bytes),
            m.gbps(),
            all.micros(),
            tu,
            tg,
            tr,
            vs_raw(t),
            if m.bytes >= BOUND_FROM {
                format!("{:.2}", t.seconds / all.seconds)
            } else {
                "-".into()
            },
            mu,
            mg,
            mr,
            mc.map(vs_raw).unwrap_or_else(|| "-".into()),
            ru,
            rg,
            rr
        );
    }
}

fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else if bytes >= 1 << 10 {
        format!("{} KiB", bytes >> 10)
    } else {
        format!("{bytes} B")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lockstep_comm::SelfComm;

    #[test]
    fn sizes_span_16_bytes_to_256m() {
        let s = default_sizes();
        assert_eq!(s.first(), Some(&16));
        assert!(s.contains(&4096));
        assert_eq!(s.last(), Some(&(256 << 20)));
    }

    #[test]
    fn timings_are_positive() {
        let through_comm = comm_all_reduce(&SelfComm);
        let t = interleaved_timings(
            &SelfComm,
            &[4096, 1 << 16],
            0.001,
            3,
            &[
                Op {
                    run: &memcpy,
                    chief_only: true,
                    reads_src: true,
                },
                Op {
                    run: &memcpy,
                    chief_only: false,
                    reads_src: true,
                },
                Op {
                    run: &through_comm,
                    chief_only: false,
                    reads_src: false,
                },
            ],
        )
        .unwrap();
        assert_eq!((t.len(), t[0].len()), (3, 2));
        for x in t.iter().flatten() {
            assert!(x.seconds > 0.0 && x.ops >= 1 && x.samples == 3);
            assert!(x.best_seconds <= x.seconds);
        }
    }

    #[test]
    fn median_and_best_of_samples() {
        let mut s = [4.0, 1.0, 3.0, 2.0, 100.0];
        let t = summarize(8, &mut s, 2);
        assert_eq!((t.seconds, t.best_seconds, t.samples), (1.5, 0.5, 5));
    }
}
