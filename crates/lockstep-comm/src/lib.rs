//! Communicators for lockstep: one trait, three backends, and the launch around them.
//!
//! What this crate guarantees:
//!
//! - **Every rank ends a collective with the same bytes.** A broadcast copies the root's
//!   bytes; an all-reduce leaves bitwise the same values on every rank: [`ThreadComm`]
//!   reduces each element in rank order 0, 1, ..., size-1 once and copies that result to every
//!   rank; `MpiComm` reduces in place with `MPI_Allreduce`, whose implementations compute each
//!   element once and distribute it (the conformance suite checks this with inexact floats).
//! - **Failures never hang.** A failed peer turns every later collective on every other rank
//!   into [`CommError::PeerFailed`] ([`ThreadComm`], within milliseconds) or ends the whole
//!   job through `MPI_Abort` (`MpiComm`, see [`install_mpi_abort_on_panic`]).
//! - **Misuse is an error, not undefined behaviour.** Unequal lengths, a root that is not a
//!   rank, or (on [`ThreadComm`]) ranks entering different collectives give
//!   [`CommError::InvalidArgument`] / [`CommError::Mismatch`] naming the rank and the fix.
//! - **Launch detection and device binding are pure functions of the environment**
//!   ([`launch::detect_launch_from`], [`launch::bind_device`]), unit-tested without a
//!   launcher; child MPI jobs started by this crate ([`launch::run_with_limit`]) never
//!   outlive their time limit.
//!
//! Every rank of a job runs the same program (SPMD) and talks to its peers only through a
//! [`Communicator`]. The backends are
//!
//! - [`SelfComm`]: one rank; every collective is a local no-op or copy;
//! - [`ThreadComm`]: one process, one thread per replica, shared-memory collectives
//!   ([`run_replicas`] starts the threads and turns any replica's failure into an error);
//! - `MpiComm` (Cargo feature `mpi`, on by default): one process per rank over MPI
//!   (Open MPI or MPICH through the `mpi` crate), launched by `mpirun` or `srun`.
//!
//! The trait itself is object safe (`&dyn Communicator`) and works on bytes and on typed
//! [`ReduceBuf`]s; the typed API that code normally calls (`broadcast(&mut [T], root)`,
//! `all_reduce(&mut [T], op)`, ...) lives in the [`CommExt`] extension trait, implemented for
//! every communicator. [`World`] puts launch, device and communicator together for a program.
//!
//! [`conformance`] is the suite every backend passes (its tests and the `lockstep-comm-check`
//! binary, which checks an MPI installation, run it).

pub mod conformance;
pub mod launch;
#[cfg(feature = "mpi")]
mod mpi_comm;
mod self_comm;
mod thread_comm;
mod world;

#[cfg(feature = "mpi")]
pub use mpi_comm::{install_mpi_abort_on_panic, mpi_in_place, MpiComm};
pub use self_comm::SelfComm;
pub use thread_comm::{run_replicas, ReplicaFailure, ThreadComm};
pub use world::{host_name, World, WorldError};

use bytemuck::Pod;
use thiserror::Error;

/// The reduction applied element by element by [`CommExt::all_reduce`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum over ranks. Floating-point sums are taken in rank order 0, 1, ..., size-1 by the
    /// shared-memory backend, so every rank gets bitwise the same result.
    Sum,
    /// Maximum over ranks.
    Max,
    /// Minimum over ranks.
    Min,
}

/// The element types a reduction supports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// 32-bit IEEE float.
    F32,
    /// 64-bit IEEE float.
    F64,
    /// Unsigned 64-bit integer (sums wrap on overflow).
    U64,
    /// Signed 64-bit integer (sums wrap on overflow).
    I64,
}

/// A typed, mutable buffer handed to [`Communicator::all_reduce_buf`].
#[derive(Debug)]
pub enum ReduceBuf<'a> {
    /// `f32` elements.
    F32(&'a mut [f32]),
    /// `f64` elements.
    F64(&'a mut [f64]),
    /// `u64` elements.
    U64(&'a mut [u64]),
    /// `i64` elements.
    I64(&'a mut [i64]),
}

impl ReduceBuf<'_> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            ReduceBuf::F32(b) => b.len(),
            ReduceBuf::F64(b) => b.len(),
            ReduceBuf::U64(b) => b.len(),
            ReduceBuf::I64(b) => b.len(),
        }
    }

    /// True when the buffer holds no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        match self {
            ReduceBuf::F32(_) => DType::F32,
            ReduceBuf::F64(_) => DType::F64,
            ReduceBuf::U64(_) => DType::U64,
            ReduceBuf::I64(_) => DType::I64,
        }
    }
}

/// Element types that [`CommExt::all_reduce`] accepts: `f32`, `f64`, `u64`, `i64`.
pub trait Reducible: Pod + Send + Sync {
    /// The element type tag.
    const DTYPE: DType;
    /// Wraps a slice as a [`ReduceBuf`].
    fn as_reduce_buf(buf: &mut [Self]) -> ReduceBuf<'_>;
    /// Applies `op` to two values (sums wrap for integers).
    fn combine(a: Self, b: Self, op: ReduceOp) -> Self;
}

macro_rules! reducible {
    ($t:ty, $variant:ident, $add:expr) => {
        impl Reducible for $t {
            const DTYPE: DType = DType::$variant;
            fn as_reduce_buf(buf: &mut [Self]) -> ReduceBuf<'_> {
                ReduceBuf::$variant(buf)
            }
            #[inline(always)]
            fn combine(a: Self, b: Self, op: ReduceOp) -> Self {
                match op {
                    ReduceOp::Sum => $add(a, b),
                    ReduceOp::Max => {
                        if b > a {
                            b
                        } else {
                            a
                        }
                    }
                    ReduceOp::Min => {
                        if b < a {
                            b
                        } else {
                            a
                        }
                    }
                }
            }
        }
    };
}
reducible!(f32, F32, |a: f32, b: f32| a + b);
reducible!(f64, F64, |a: f64, b: f64| a + b);
reducible!(u64, U64, u64::wrapping_add);
reducible!(i64, I64, i64::wrapping_add);

/// Errors of a collective operation.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum CommError {
    /// Another rank failed (panic, error or exit); this rank's collective was abandoned.
    #[error("rank {rank} failed: {message}")]
    PeerFailed {
        /// The rank that failed first.
        rank: usize,
        /// What it reported.
        message: String,
    },
    /// The arguments of a collective are inconsistent (lengths, counts, root).
    #[error("invalid arguments to {op} on rank {rank}: {detail}")]
    InvalidArgument {
        /// The collective.
        op: &'static str,
        /// The rank that detected the problem.
        rank: usize,
        /// What is wrong and how to fix it.
        detail: String,
    },
    /// Ranks entered different collectives (a control-flow divergence between replicas).
    #[error("collective mismatch: rank {rank} called {this} while rank {other_rank} called {other}; every rank must call the same collectives in the same order")]
    Mismatch {
        /// This rank.
        rank: usize,
        /// The collective this rank called.
        this: String,
        /// A rank that called something else.
        other_rank: usize,
        /// What that rank called.
        other: String,
    },
    /// The backend cannot be set up (e.g. MPI already initialised, unsupported build).
    #[error("communicator setup failed: {0}")]
    Setup(String),
}

/// The collective interface every backend implements (object safe).
///
/// Every method except [`rank`](Communicator::rank), [`size`](Communicator::size) and
/// [`is_chief`](Communicator::is_chief) is a *collective*: every rank must call the same
/// collectives in the same order with consistent arguments. Code normally uses the typed
/// wrappers of [`CommExt`].
pub trait Communicator {
    /// This process's (or replica thread's) index in the group, `0..size()`.
    fn rank(&self) -> usize;
    /// Number of ranks in the group (the replica count).
    fn size(&self) -> usize;
    /// True on rank 0, the chief: the only rank that writes outputs.
    fn is_chief(&self) -> bool {
        self.rank() == 0
    }
    /// Short backend name: `"self"`, `"threads"` or `"mpi"`.
    fn backend(&self) -> &'static str;
    /// Blocks until every rank has entered the barrier.
    fn barrier(&self) -> Result<(), CommError>;
    /// Copies `buf` of rank `root` into `buf` of every rank; every rank passes the same length.
    fn broadcast_bytes(&self, buf: &mut [u8], root: usize) -> Result<(), CommError>;
    /// Element-wise reduction of equally long buffers; the result lands on every rank.
    fn all_reduce_buf(&self, buf: ReduceBuf<'_>, op: ReduceOp) -> Result<(), CommError>;
    /// Root receives the `send` of rank r at `recv[r*n..(r+1)*n]` (`n = send.len()`, equal on
    /// all ranks; `recv.len() == size*n` on the root, ignored elsewhere).
    fn gather_bytes(&self, send: &[u8], recv: &mut [u8], root: usize) -> Result<(), CommError>;
    /// Rank r receives `send[r*n..(r+1)*n]` of the root (`n = recv.len()`, equal on all ranks;
    /// `send.len() == size*n` on the root, ignored elsewhere).
    fn scatter_bytes(&self, send: &[u8], recv: &mut [u8], root: usize) -> Result<(), CommError>;
    /// Every rank receives every rank's `send` concatenated in rank order
    /// (`recv.len() == size*send.len()`).
    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> Result<(), CommError>;
    /// Personalised exchange with variable counts: `send` is the concatenation of the byte
    /// blocks for ranks 0..size, `send_counts[d]` bytes for rank d (zero allowed). On return
    /// `recv` holds the blocks received from ranks 0..size concatenated, and the result is
    /// the byte count received from each rank.
    fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut Vec<u8>,
    ) -> Result<Vec<usize>, CommError>;
    /// Ends the whole job (every rank) now with exit status `code`, after flushing stderr.
    fn abort(&self, code: i32) -> !;
}

/// Typed collectives on any [`Communicator`] (blanket-implemented, also for `dyn Communicator`).
pub trait CommExt: Communicator {
    /// Broadcast of `buf` (any plain-old-data element type) from `root`.
    fn broadcast<T: Pod>(&self, buf: &mut [T], root: usize) -> Result<(), CommError> {
        self.broadcast_bytes(bytemuck::cast_slice_mut(buf), root)
    }

    /// Element-wise reduction of `buf` (f32, f64, u64 or i64) over all ranks, in place.
    fn all_reduce<T: Reducible>(&self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        self.all_reduce_buf(T::as_reduce_buf(buf), op)
    }

    /// Reduction of one value; returns the result.
    fn all_reduce_scalar<T: Reducible>(&self, value: T, op: ReduceOp) -> Result<T, CommError> {
        let mut v = [value];
        self.all_reduce(&mut v, op)?;
        Ok(v[0])
    }

    /// Gather of equal slices to `root` (see [`Communicator::gather_bytes`]).
    fn gather<T: Pod>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<(), CommError> {
        self.gather_bytes(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            root,
        )
    }

    /// Scatter of equal slices from `root` (see [`Communicator::scatter_bytes`]).
    fn scatter<T: Pod>(&self, send: &[T], recv: &mut [T], root: usize) -> Result<(), CommError> {
        self.scatter_bytes(
            bytemuck::cast_slice(send),
            bytemuck::cast_slice_mut(recv),
            root,
        )
    }

    /// All-gather of equal slices (see [`Communicator::all_gather_bytes`]).
    fn all_gather<T: Pod>(&self, send: &[T], recv: &mut [T]) -> Result<(), CommError> {
        self.all_gather_bytes(bytemuck::cast_slice(send), bytemuck::cast_slice_mut(recv))
    }

    /// All-gather returning a new vector of `size * send.len()` elements.
    fn all_gather_vec<T: Pod>(&self, send: &[T]) -> Result<Vec<T>, CommError> {
        let mut recv = vec![T::zeroed(); send.len() * self.size()];
        self.all_gather(send, &mut recv)?;
        Ok(recv)
    }

    /// Personalised exchange with variable counts, in elements: `send_counts[d]` elements of
    /// `send` go to rank d (in order). Returns the received elements (blocks from ranks
    /// 0..size concatenated) and the element count received from each rank.
    fn all_to_all_v<T: Pod>(
        &self,
        send: &[T],
        send_counts: &[usize],
    ) -> Result<(Vec<T>, Vec<usize>), CommError> {
        let elem = std::mem::size_of::<T>();
        let byte_counts: Vec<usize> = send_counts.iter().map(|c| c * elem).collect();
        let mut recv_bytes = Vec::new();
        let recv_counts =
            self.all_to_all_v_bytes(bytemuck::cast_slice(send), &byte_counts, &mut recv_bytes)?;
        let total: usize = recv_counts.iter().sum();
        let mut out = vec![T::zeroed(); total / elem.max(1)];
        bytemuck::cast_slice_mut::<T, u8>(&mut out).copy_from_slice(&recv_bytes[..total]);
        Ok((out, recv_counts.iter().map(|c| c / elem.max(1)).collect()))
    }
}

impl<C: Communicator + ?Sized> CommExt for C {}

/// Checks `all_to_all_v_bytes` arguments on one rank.
pub(crate) fn check_counts(
    rank: usize,
    size: usize,
    send: &[u8],
    send_counts: &[usize],
) -> Result<(), CommError> {
    if send_counts.len() != size {
        return Err(CommError::InvalidArgument {
            op: "all_to_all_v",
            rank,
            detail: format!(
                "send_counts has {} entries but the group has {size} ranks; pass one count per rank",
                send_counts.len()
            ),
        });
    }
    let total: usize = send_counts.iter().sum();
    if total != send.len() {
        return Err(CommError::InvalidArgument {
            op: "all_to_all_v",
            rank,
            detail: format!(
                "send_counts sum to {total} but the send buffer holds {}; they must be equal",
                send.len()
            ),
        });
    }
    Ok(())
}

/// Checks that `root` names a rank.
pub(crate) fn check_root(
    op: &'static str,
    rank: usize,
    size: usize,
    root: usize,
) -> Result<(), CommError> {
    if root >= size {
        return Err(CommError::InvalidArgument {
            op,
            rank,
            detail: format!("root {root} is not a rank of this {size}-rank group"),
        });
    }
    Ok(())
}

/// Prints `message` to stderr and flushes it; used before aborting so the reason survives.
pub fn eprint_flush(message: &str) {
    use std::io::Write;
    let mut err = std::io::stderr().lock();
    let _ = writeln!(err, "{message}");
    let _ = err.flush();
}
