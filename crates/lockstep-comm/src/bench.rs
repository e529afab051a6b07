//! Measurement helpers for `lockstep bench allreduce`: all-reduce time per size on any
//! communicator, and a single-core `memcpy` of the same size as the yardstick.

use crate::{CommError, CommExt, Communicator, ReduceOp};
use std::time::Instant;

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
    use crate::SelfComm;

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
