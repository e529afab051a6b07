//! One process per rank over MPI (Open MPI or MPICH) through the `mpi` crate (rsmpi).

use crate::{check_counts, check_root, CommError, Communicator, ReduceBuf, ReduceOp, Reducible};
use mpi::collective::SystemOperation;
use mpi::datatype::{Equivalence, Partition, PartitionMut};
use mpi::environment::Universe;
use mpi::raw::AsRaw;
use mpi::topology::{Process, SimpleCommunicator};
use mpi::traits::{Communicator as _, CommunicatorCollectives as _, Root as _};
use std::ffi::{c_int, c_void};

extern "C" {
    /// `MPI_IN_PLACE` of the linked MPI library, compiled from its `mpi.h` by `build.rs`
    /// (`csrc/mpi_constants.c`); rsmpi 0.8 does not export it.
    static lockstep_mpi_in_place: *mut c_void;
}

/// The linked MPI library's `MPI_IN_PLACE` sentinel (Open MPI `(void *) 1`, MPICH
/// `(void *) -1`), for callers of the raw `mpi::ffi` bindings: pass it as the send buffer of
/// `MPI_Allreduce` to reduce the receive buffer in place. rsmpi 0.8 does not export it.
pub fn mpi_in_place() -> *mut c_void {
    // SAFETY: a constant initialised at load time by the C compiler and never written.
    unsafe { lockstep_mpi_in_place }
}

/// A real address for empty buffers: an empty `&[u8]` points at address 1, which Open MPI
/// reads as `MPI_IN_PLACE`.
static EMPTY: [u8; 8] = [0; 8];

fn nonempty(buf: &[u8]) -> &[u8] {
    if buf.is_empty() {
        &EMPTY[..0]
    } else {
        buf
    }
}

/// Largest element count handed to one MPI call (MPI counts are C `int`).
const MAX_COUNT: usize = 1 << 30;

/// A rank of `MPI_COMM_WORLD`.
///
/// Creating it initialises MPI (`MPI_Init_thread`, funneled: only the thread that created it
/// calls MPI) and installs a panic hook that aborts the whole job ([`install_mpi_abort_on_panic`]);
/// dropping it finalises MPI. MPI's default error handler (`MPI_ERRORS_ARE_FATAL`) stays in
/// place, so an MPI-level failure also ends every rank.
pub struct MpiComm {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    _universe: Universe,
}

impl std::fmt::Debug for MpiComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "MpiComm(rank {} of {})", self.rank, self.size)
    }
}

impl MpiComm {
    /// Initialises MPI and returns this process's rank of the world communicator.
    ///
    /// Errors: [`CommError::Setup`] when MPI was already initialised in this process.
    pub fn init() -> Result<MpiComm, CommError> {
        let (universe, _threading) = mpi::initialize_with_threading(mpi::Threading::Funneled)
            .ok_or_else(|| CommError::Setup("MPI is already initialised in this process".into()))?;
        let world = universe.world();
        let rank = world.rank() as usize;
        let size = world.size() as usize;
        install_mpi_abort_on_panic(rank);
        Ok(MpiComm {
            world,
            rank,
            size,
            _universe: universe,
        })
    }

    /// The MPI library's version string (`MPI_Get_library_version`).
    pub fn library_version() -> String {
        mpi::environment::library_version().unwrap_or_else(|_| "unknown".into())
    }

    /// This host's name as MPI reports it (`MPI_Get_processor_name`).
    pub fn processor_name() -> String {
        mpi::environment::processor_name().unwrap_or_else(|_| "unknown".into())
    }

    fn root(&self, root: usize) -> Process<'_> {
        self.world.process_at_rank(root as i32)
    }

    /// `MPI_Allreduce` with `MPI_IN_PLACE` on `buf` (no send copy), in pieces of at most
    /// [`MAX_COUNT`] elements (MPI counts are C `int`). Smaller pieces (2 MiB) were tried and
    /// were not faster than one call with Open MPI's samples interleaved in one
    /// `lockstep bench allreduce` run (64 MiB: 19.0 ms vs 18.5 ms; 256 MiB: 69 vs 65 ms).
    ///
    /// Errors: [`CommError::Setup`] if MPI returns an error code (with MPI's default error
    /// handler, `MPI_ERRORS_ARE_FATAL`, it aborts the job instead).
    fn reduce_typed<T: Reducible + Equivalence>(
        &self,
        buf: &mut [T],
        op: ReduceOp,
    ) -> Result<(), CommError> {
        let op = match op {
            ReduceOp::Sum => SystemOperation::sum(),
            ReduceOp::Max => SystemOperation::max(),
            ReduceOp::Min => SystemOperation::min(),
        };
        let datatype = T::equivalent_datatype();
        for part in buf.chunks_mut(MAX_COUNT) {
            // SAFETY: `part` is a live, exclusively borrowed buffer of `part.len()` elements of
            // the MPI datatype equivalent to T; MPI_IN_PLACE makes it both input and output,
            // and MPI_Allreduce is blocking, so MPI touches it only during this call. Only the
            // thread that initialised MPI calls MPI (MpiComm holds a raw communicator handle, so
            // it is neither Send nor Sync). The count fits a C int (MAX_COUNT < 2^31).
            let code = unsafe {
                mpi::ffi::MPI_Allreduce(
                    mpi_in_place(),
                    part.as_mut_ptr().cast::<c_void>(),
                    part.len() as c_int,
                    datatype.as_raw(),
                    op.as_raw(),
                    self.world.as_raw(),
                )
            };
            if code != 0 {
                return Err(CommError::Setup(format!(
                    "MPI_Allreduce returned error code {code} on rank {}",
                    self.rank
                )));
            }
        }
        Ok(())
    }
}

/// Installs a panic hook that prints the panic (through the previous hook), names the rank,
/// flushes stderr and calls `MPI_Abort(MPI_COMM_WORLD, 101)`, so that a panic on any rank,
/// in any thread, ends every rank of the job instead of leaving the peers waiting.
pub fn install_mpi_abort_on_panic(rank: usize) {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        previous(info);
        crate::eprint_flush(&format!(
            "lockstep: rank {rank} panicked; aborting the MPI job"
        ));
        // SAFETY: MPI is initialised (the hook is installed by MpiComm::init) and
        // MPI_Abort may be called from any thread; it does not return.
        unsafe {
            mpi::ffi::MPI_Abort(mpi::ffi::RSMPI_COMM_WORLD, 101);
        }
    }));
}

fn count_i32(op: &'static str, rank: usize, n: usize) -> Result<i32, CommError> {
    i32::try_from(n).map_err(|_| CommError::InvalidArgument {
        op,
        rank,
        detail: format!(
            "{n} bytes exceed MPI's per-call limit of {} bytes; split the exchange",
            i32::MAX
        ),
    })
}

impl Communicator for MpiComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.world.barrier();
        Ok(())
    }

    fn broadcast_bytes(&self, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        check_root("broadcast", self.rank, self.size, root)?;
        let root = self.root(root);
        for part in buf.chunks_mut(MAX_COUNT) {
            root.broadcast_into(part);
        }
        Ok(())
    }

    fn all_reduce_buf(&self, buf: ReduceBuf<'_>, op: ReduceOp) -> Result<(), CommError> {
        match buf {
            ReduceBuf::F32(b) => self.reduce_typed(b, op),
            ReduceBuf::F64(b) => self.reduce_typed(b, op),
            ReduceBuf::U64(b) => self.reduce_typed(b, op),
            ReduceBuf::I64(b) => self.reduce_typed(b, op),
        }
    }

    fn gather_bytes(&self, send: &[u8], recv: &mut [u8], root: usize) -> Result<(), CommError> {
        check_root("gather", self.rank, self.size, root)?;
        count_i32("gather", self.rank, send.len() * self.size)?;
        if send.is_empty() {
            // Equal on every rank: nothing to move (and an empty slice would read as MPI_IN_PLACE).
            return Ok(());
        }
        if self.rank == root {
            if recv.len() != send.len() * self.size {
                return Err(CommError::InvalidArgument {
                    op: "gather",
                    rank: self.rank,
                    detail: format!(
                        "the root's receive buffer holds {} bytes but {} ranks x {} bytes are gathered",
                        recv.len(),
                        self.size,
                        send.len()
                    ),
                });
            }
            self.root(root).gather_into_root(send, recv);
        } else {
            self.root(root).gather_into(send);
        }
        Ok(())
    }

    fn scatter_bytes(&self, send: &[u8], recv: &mut [u8], root: usize) -> Result<(), CommError> {
        check_root("scatter", self.rank, self.size, root)?;
        count_i32("scatter", self.rank, recv.len() * self.size)?;
        if recv.is_empty() {
            return Ok(());
        }
        if self.rank == root {
            if send.len() != recv.len() * self.size {
                return Err(CommError::InvalidArgument {
                    op: "scatter",
                    rank: self.rank,
                    detail: format!(
                        "the root's send buffer holds {} bytes but {} ranks x {} bytes are scattered",
                        send.len(),
                        self.size,
                        recv.len()
                    ),
                });
            }
            self.root(root).scatter_into_root(send, recv);
        } else {
            self.root(root).scatter_into(recv);
        }
        Ok(())
    }

    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> Result<(), CommError> {
        count_i32("all_gather", self.rank, recv.len())?;
        if recv.len() != send.len() * self.size {
            return Err(CommError::InvalidArgument {
                op: "all_gather",
                rank: self.rank,
                detail: format!(
                    "receive buffer holds {} bytes but {} ranks x {} bytes are gathered",
                    recv.len(),
                    self.size,
                    send.len()
                ),
            });
        }
        if !send.is_empty() {
            self.world.all_gather_into(send, recv);
        }
        Ok(())
    }

    fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut Vec<u8>,
    ) -> Result<Vec<usize>, CommError> {
        check_counts(self.rank, self.size, send, send_counts)?;
        let counts_u64: Vec<u64> = send_counts.iter().map(|&c| c as u64).collect();
        let mut recv_counts_u64 = vec![0u64; self.size];
        self.world
            .all_to_all_into(&counts_u64[..], &mut recv_counts_u64[..]);
        let recv_counts: Vec<usize> = recv_counts_u64.iter().map(|&c| c as usize).collect();
        let to_i32 = |v: &[usize]| -> Result<(Vec<i32>, Vec<i32>), CommError> {
            let mut counts = Vec::with_capacity(v.len());
            let mut displs = Vec::with_capacity(v.len());
            let mut at = 0usize;
            for &c in v {
                displs.push(count_i32("all_to_all_v", self.rank, at)?);
                counts.push(count_i32("all_to_all_v", self.rank, c)?);
                at += c;
            }
            count_i32("all_to_all_v", self.rank, at)?;
            Ok((counts, displs))
        };
        let (scounts, sdispls) = to_i32(send_counts)?;
        let (rcounts, rdispls) = to_i32(&recv_counts)?;
        recv.clear();
        recv.resize(recv_counts.iter().sum(), 0);
        let sendp = Partition::new(nonempty(send), &scounts[..], &sdispls[..]);
        let mut empty = [0u8; 8];
        let recv_buf: &mut [u8] = if recv.is_empty() {
            &mut empty[..0]
        } else {
            &mut recv[..]
        };
        let mut recvp = PartitionMut::new(recv_buf, &rcounts[..], &rdispls[..]);
        self.world.all_to_all_varcount_into(&sendp, &mut recvp);
        Ok(recv_counts)
    }

    fn abort(&self, code: i32) -> ! {
        crate::eprint_flush(&format!(
            "lockstep: rank {} aborts the MPI job (exit code {code})",
            self.rank
        ));
        self.world.abort(code)
    }
}
