//! One process, one thread per replica: shared-memory collectives.
//!
//! Each collective publishes the caller's buffer address in a per-rank slot, meets the other
//! ranks at a barrier, then reads the peers' buffers directly. The all-reduce splits the
//! buffers into `size` contiguous chunks; rank r reduces chunk r (reading it from every rank,
//! in rank order 0, 1, ..., size-1) block by block and writes each reduced block into chunk r
//! of every rank's buffer, so all ranks get bitwise identical results in one pass. Chunk r of
//! every buffer is touched only by rank r between the two barriers. Each rank reads and
//! writes about `n` elements in all, whatever the group size (a memcpy's traffic).
//!
//! An all-reduce of at most 256 bytes travels inline in the slots instead: each rank copies
//! its buffer in, meets the others at one barrier and reduces all copies itself, in rank order.
//!
//! The barrier spins for up to [`SPIN`] (`std::hint::spin_loop`), so back-to-back small
//! collectives cost microseconds, then sleeps on a condition variable. It is poisonable: when
//! a replica fails (error or panic, see [`run_replicas`]) or a collective is misused, the
//! group is poisoned and every rank spinning or sleeping in, or later entering, a collective
//! gets [`CommError::PeerFailed`] at once. Nothing waits forever on a dead peer.

use crate::{check_counts, check_root, CommError, Communicator, ReduceBuf, ReduceOp, Reducible};
use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use Ordering::{Acquire, Relaxed, SeqCst};

/// How long a rank spins in a barrier before it sleeps. Peers in step (back-to-back
/// collectives) arrive within microseconds; a peer that is still computing lets the waiter
/// sleep after this bounded spin, so a waiting replica costs a core for at most this long.
const SPIN: Duration = Duration::from_micros(50);

#[derive(Default)]
struct Slot {
    tag: AtomicU64,
    ptr: AtomicUsize,
    len: AtomicUsize,
    aux: AtomicUsize,
    /// The buffer of a small all-reduce, copied in before the barrier.
    small: [AtomicU64; SMALL_WORDS],
}

/// 8-byte words of an all-reduce that travel inline in the slots (256 bytes: 64 f32 or 32
/// f64). Each rank then reduces every rank's copy itself, in rank order, and nobody reads
/// another rank's buffer: one barrier instead of two.
const SMALL_WORDS: usize = 32;

struct Shared {
    size: usize,
    /// Ranks that have entered the current barrier.
    arrived: AtomicUsize,
    /// Completed barriers; waiters spin or sleep until it changes.
    generation: AtomicU64,
    /// Ranks asleep on `cv`: the last arriver takes the lock to wake them only when nonzero.
    sleepers: AtomicUsize,
    /// Set together with `failure` (under its lock); spinning waiters poll it.
    failed: AtomicBool,
    /// The first failure: rank and message.
    failure: Mutex<Option<(usize, String)>>,
    cv: Condvar,
    /// Two slot sets, used alternately by consecutive collectives: a fast rank can only write
    /// a set again two collectives later, after every rank has left the collective that read it.
    slots: [Vec<Slot>; 2],
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Option<(usize, String)>> {
        self.failure.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn poison(&self, rank: usize, message: String) {
        let mut f = self.lock();
        if f.is_none() {
            *f = Some((rank, message));
        }
        self.failed.store(true, SeqCst);
        drop(f);
        self.cv.notify_all();
    }

    fn failure(&self) -> Option<(usize, String)> {
        self.lock().clone()
    }
}

/// A rank of a group of replica threads in one process.
///
/// Create a group with [`run_replicas`] (recommended: it starts one named thread per rank and
/// turns a failure anywhere into an error) or [`ThreadComm::group`].
pub struct ThreadComm {
    rank: usize,
    shared: Arc<Shared>,
    /// Collectives this rank has entered (selects the slot set).
    calls: AtomicU64,
}

impl fmt::Debug for ThreadComm {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ThreadComm(rank {} of {})", self.rank, self.shared.size)
    }
}

// Collective kinds, encoded in the slot tag so that ranks entering different collectives
// are caught (bits 0..8 kind, 8..16 dtype/op, 16.. root).
const K_BARRIER: u64 = 1;
const K_BCAST: u64 = 2;
const K_REDUCE: u64 = 3;
const K_GATHER: u64 = 4;
const K_SCATTER: u64 = 5;
const K_ALLGATHER: u64 = 6;
const K_ALLTOALLV: u64 = 7;

fn tag(kind: u64, sub: u64, root: usize) -> u64 {
    kind | (sub << 8) | ((root as u64) << 16)
}

fn describe(tag: u64) -> String {
    let kind = match tag & 0xff {
        K_BARRIER => "barrier",
        K_BCAST => "broadcast",
        K_REDUCE => "all_reduce",
        K_GATHER => "gather",
        K_SCATTER => "scatter",
        K_ALLGATHER => "all_gather",
        K_ALLTOALLV => "all_to_all_v",
        _ => "an unknown collective",
    };
    match tag & 0xff {
        K_BCAST | K_GATHER | K_SCATTER => format!("{kind}(root {})", tag >> 16),
        K_REDUCE => format!("{kind}(dtype/op code {})", (tag >> 8) & 0xff),
        _ => kind.to_string(),
    }
}

/// Splits `n` elements into `size` contiguous chunks aligned to 16 elements; returns chunk
/// `c` as a half-open range.
fn chunk(n: usize, size: usize, c: usize) -> (usize, usize) {
    let per = n.div_ceil(size).div_ceil(16) * 16;
    let lo = (c * per).min(n);
    let hi = ((c + 1) * per).min(n);
    (lo, hi)
}

impl ThreadComm {
    /// Creates the `size` ranks of a new group; hand one to each replica thread.
    ///
    /// When the threads are managed by the caller, a failing replica must call
    /// [`ThreadComm::poison`] (or the peers wait for it); [`run_replicas`] does that.
    pub fn group(size: usize) -> Vec<ThreadComm> {
        assert!(size > 0, "a ThreadComm group needs at least one rank");
        let shared = Arc::new(Shared {
            size,
            arrived: AtomicUsize::new(0),
            generation: AtomicU64::new(0),
            sleepers: AtomicUsize::new(0),
            failed: AtomicBool::new(false),
            failure: Mutex::new(None),
            cv: Condvar::new(),
            slots: [
                (0..size).map(|_| Slot::default()).collect(),
                (0..size).map(|_| Slot::default()).collect(),
            ],
        });
        (0..size)
            .map(|rank| ThreadComm {
                rank,
                shared: shared.clone(),
                calls: AtomicU64::new(0),
            })
            .collect()
    }

    /// Marks the group failed because of this rank; every peer's current and later
    /// collectives return [`CommError::PeerFailed`] naming this rank and `message`.
    pub fn poison(&self, message: impl Into<String>) {
        self.shared.poison(self.rank, message.into());
    }

    fn fail(&self, err: CommError) -> CommError {
        self.shared.poison(self.rank, err.to_string());
        err
    }

    fn peer_failed(&self) -> CommError {
        let (rank, message) = self
            .shared
            .failure()
            .unwrap_or((self.rank, "unknown failure".into()));
        CommError::PeerFailed { rank, message }
    }

    /// The poisonable barrier: spins for up to [`SPIN`], then sleeps on the condition variable.
    ///
    /// The last rank to arrive resets the count and advances the generation; the others wait
    /// for the generation to change. A sleeper registers in `sleepers` and re-checks the
    /// generation under the lock; the last arriver advances the generation before it reads
    /// `sleepers` (both sequentially consistent), so either the sleeper sees the new generation
    /// or the arriver sees the sleeper and wakes it under the lock: no wake-up is lost.
    fn sync(&self) -> Result<(), CommError> {
        let sh = &*self.shared;
        if sh.failed.load(Acquire) {
            return Err(self.peer_failed());
        }
        let gen = sh.generation.load(Acquire);
        if sh.arrived.fetch_add(1, SeqCst) + 1 == sh.size {
            sh.arrived.store(0, Relaxed);
            sh.generation.fetch_add(1, SeqCst);
            if sh.sleepers.load(SeqCst) > 0 {
                drop(sh.lock());
                sh.cv.notify_all();
            }
            return Ok(());
        }
        let start = Instant::now();
        let mut spins: u32 = 0;
        loop {
            if sh.generation.load(Acquire) != gen {
                return Ok(());
            }
            if sh.failed.load(Relaxed) {
                return Err(self.peer_failed());
            }
            std::hint::spin_loop();
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && start.elapsed() > SPIN {
                break;
            }
        }
        let mut failure = sh.lock();
        sh.sleepers.fetch_add(1, SeqCst);
        let done = loop {
            if sh.generation.load(SeqCst) != gen {
                break true;
            }
            if failure.is_some() {
                break false;
            }
            failure = sh.cv.wait(failure).unwrap_or_else(|e| e.into_inner());
        };
        sh.sleepers.fetch_sub(1, SeqCst);
        drop(failure);
        if done {
            Ok(())
        } else {
            Err(self.peer_failed())
        }
    }

    /// Publishes this rank's arguments, meets the peers, and checks that every rank entered
    /// the same collective.
    fn enter(&self, tag: u64, ptr: usize, len: usize, aux: usize) -> Result<(), CommError> {
        let set = (self.calls.fetch_add(1, Relaxed) % 2) as usize;
        let slot = &self.shared.slots[set][self.rank];
        slot.tag.store(tag, Relaxed);
        slot.ptr.store(ptr, Relaxed);
        slot.len.store(len, Relaxed);
        slot.aux.store(aux, Relaxed);
        self.sync()?;
        for (q, other) in self.shared.slots[set].iter().enumerate() {
            let t = other.tag.load(Relaxed);
            if t != tag {
                return Err(self.fail(CommError::Mismatch {
                    rank: self.rank,
                    this: describe(tag),
                    other_rank: q,
                    other: describe(t),
                }));
            }
        }
        Ok(())
    }

    /// Rank q's published arguments of the current collective.
    fn slot(&self, q: usize) -> (usize, usize, usize) {
        let set = ((self.calls.load(Relaxed) + 1) % 2) as usize;
        let s = &self.shared.slots[set][q];
        (
            s.ptr.load(Relaxed),
            s.len.load(Relaxed),
            s.aux.load(Relaxed),
        )
    }

    fn invalid(&self, op: &'static str, detail: String) -> CommError {
        self.fail(CommError::InvalidArgument {
            op,
            rank: self.rank,
            detail,
        })
    }

    fn reduce_typed<T: Reducible>(&self, buf: &mut [T], op: ReduceOp) -> Result<(), CommError> {
        let size = self.shared.size;
        let n = buf.len();
        let bytes = std::mem::size_of_val(buf);
        let small = size > 1 && bytes <= SMALL_WORDS * 8;
        if small {
            // The slot set `enter` is about to use.
            let set = (self.calls.load(Relaxed) % 2) as usize;
            let mut words = [0u64; SMALL_WORDS];
            bytemuck::cast_slice_mut::<u64, u8>(&mut words)[..bytes]
                .copy_from_slice(bytemuck::cast_slice(buf));
            let slot = &self.shared.slots[set][self.rank].small;
            for (w, &v) in slot.iter().zip(&words[..bytes.div_ceil(8)]) {
                w.store(v, Relaxed);
            }
        }
        let base = buf.as_mut_ptr();
        let op_code = (T::DTYPE as u64) * 4 + op as u64;
        self.enter(tag(K_REDUCE, op_code, 0), base as usize, n, 0)?;
        for q in 0..size {
            let len = self.slot(q).1;
            if len != n {
                return Err(self.invalid(
                    "all_reduce",
                    format!("rank {q} passes {len} elements, rank {} passes {n}; every rank must reduce a buffer of the same length", self.rank),
                ));
            }
        }
        if small {
            // Every rank's copy is visible after the barrier and is not rewritten before the
            // barrier of the next collective has passed (alternating slot sets).
            let set = ((self.calls.load(Relaxed) + 1) % 2) as usize;
            let load = |q: usize| {
                let mut words = [0u64; SMALL_WORDS];
                for (w, a) in words.iter_mut().zip(&self.shared.slots[set][q].small) {
                    *w = a.load(Relaxed);
                }
                words
            };
            let mut acc = load(0);
            let acc = &mut bytemuck::cast_slice_mut::<u64, T>(&mut acc)[..n];
            for q in 1..size {
                let words = load(q);
                let src = &bytemuck::cast_slice::<u64, T>(&words)[..n];
                for (a, &b) in acc.iter_mut().zip(src) {
                    *a = T::combine(*a, b, op);
                }
            }
            buf.copy_from_slice(acc);
            return Ok(());
        }
        if size == 1 {
            return self.sync();
        }
        let ptrs: Vec<*mut T> = (0..size).map(|q| self.slot(q).0 as *mut T).collect();
        let (lo, hi) = chunk(n, size, self.rank);
        match op {
            ReduceOp::Sum => reduce_chunk(&ptrs, lo, hi, |a, b| T::combine(a, b, ReduceOp::Sum)),
            ReduceOp::Max => reduce_chunk(&ptrs, lo, hi, |a, b| T::combine(a, b, ReduceOp::Max)),
            ReduceOp::Min => reduce_chunk(&ptrs, lo, hi, |a, b| T::combine(a, b, ReduceOp::Min)),
        }
        // Every chunk of every buffer is final once all ranks are here; no rank returns (and
        // frees or reuses its buffer) while a peer may still write into it.
        self.sync()
    }
}

/// Reduces elements `lo..hi` of every rank's buffer (in rank order 0, 1, ...) block by block
/// and writes each reduced block back into elements `lo..hi` of every rank's buffer.
fn reduce_chunk<T: Reducible>(ptrs: &[*mut T], lo: usize, hi: usize, f: impl Fn(T, T) -> T) {
    const BLOCK: usize = 1024;
    let mut tmp = [T::zeroed(); BLOCK];
    let mut i = lo;
    while i < hi {
        let m = BLOCK.min(hi - i);
        // SAFETY: every pointer addresses a live buffer of at least `hi` elements (lengths were
        // checked equal after the entry barrier, and each buffer stays alive until the closing
        // barrier). Between the two barriers, elements lo..hi (this rank's chunk) of every
        // buffer are read and written by this rank only: the owners are inside the collective
        // and touch only their own chunks, which do not overlap this one. Each block is read
        // completely before it is written.
        unsafe {
            ptr::copy_nonoverlapping(ptrs[0].add(i), tmp.as_mut_ptr(), m);
            for &p in &ptrs[1..] {
                let src = std::slice::from_raw_parts(p.add(i), m);
                for (t, &s) in tmp[..m].iter_mut().zip(src) {
                    *t = f(*t, s);
                }
            }
            for &p in ptrs {
                ptr::copy_nonoverlapping(tmp.as_ptr(), p.add(i), m);
            }
        }
        i += m;
    }
}

impl Communicator for ThreadComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.shared.size
    }

    fn backend(&self) -> &'static str {
        "threads"
    }

    fn barrier(&self) -> Result<(), CommError> {
        self.enter(tag(K_BARRIER, 0, 0), 0, 0, 0)
    }

    fn broadcast_bytes(&self, buf: &mut [u8], root: usize) -> Result<(), CommError> {
        let size = self.shared.size;
        check_root("broadcast", self.rank, size, root).map_err(|e| self.fail(e))?;
        let n = buf.len();
        let base = buf.as_mut_ptr();
        self.enter(tag(K_BCAST, 0, root), base as usize, n, 0)?;
        for q in 0..size {
            let len = self.slot(q).1;
            if len != n {
                return Err(self.invalid(
                    "broadcast",
                    format!("rank {q} passes {len} bytes, rank {} passes {n}; every rank must pass a buffer of the root's length", self.rank),
                ));
            }
        }
        if self.rank != root {
            let src = self.slot(root).0 as *const u8;
            // SAFETY: the root's buffer is alive until the closing barrier and is only read.
            unsafe { ptr::copy_nonoverlapping(src, base, n) };
        }
        self.sync()
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
        let size = self.shared.size;
        check_root("gather", self.rank, size, root).map_err(|e| self.fail(e))?;
        let n = send.len();
        self.enter(
            tag(K_GATHER, 0, root),
            send.as_ptr() as usize,
            n,
            recv.len(),
        )?;
        for q in 0..size {
            let len = self.slot(q).1;
            if len != n {
                return Err(self.invalid(
                    "gather",
                    format!("rank {q} sends {len} bytes, rank {} sends {n}; all ranks must send equal slices", self.rank),
                ));
            }
        }
        let root_recv = self.slot(root).2;
        if root_recv != size * n {
            return Err(self.invalid(
                "gather",
                format!("the root's receive buffer holds {root_recv} bytes but {size} ranks x {n} bytes = {} are gathered", size * n),
            ));
        }
        if self.rank == root {
            for q in 0..size {
                let src = self.slot(q).0 as *const u8;
                // SAFETY: rank q's send buffer is alive and unchanged until the closing barrier.
                unsafe { ptr::copy_nonoverlapping(src, recv.as_mut_ptr().add(q * n), n) };
            }
        }
        self.sync()
    }

    fn scatter_bytes(&self, send: &[u8], recv: &mut [u8], root: usize) -> Result<(), CommError> {
        let size = self.shared.size;
        check_root("scatter", self.rank, size, root).map_err(|e| self.fail(e))?;
        let n = recv.len();
        self.enter(
            tag(K_SCATTER, 0, root),
            send.as_ptr() as usize,
            send.len(),
            n,
        )?;
        for q in 0..size {
            let len = self.slot(q).2;
            if len != n {
                return Err(self.invalid(
                    "scatter",
                    format!("rank {q} receives {len} bytes, rank {} receives {n}; all ranks must receive equal slices", self.rank),
                ));
            }
        }
        let (src, root_send, _) = self.slot(root);
        if root_send != size * n {
            return Err(self.invalid(
                "scatter",
                format!("the root's send buffer holds {root_send} bytes but {size} ranks x {n} bytes = {} are scattered", size * n),
            ));
        }
        // SAFETY: the root's send buffer is alive and unchanged until the closing barrier.
        unsafe {
            ptr::copy_nonoverlapping((src as *const u8).add(self.rank * n), recv.as_mut_ptr(), n)
        };
        self.sync()
    }

    fn all_gather_bytes(&self, send: &[u8], recv: &mut [u8]) -> Result<(), CommError> {
        let size = self.shared.size;
        let n = send.len();
        self.enter(
            tag(K_ALLGATHER, 0, 0),
            send.as_ptr() as usize,
            n,
            recv.len(),
        )?;
        for q in 0..size {
            let (_, len, rlen) = self.slot(q);
            if len != n || rlen != size * n {
                return Err(self.invalid(
                    "all_gather",
                    format!("rank {q} sends {len} and receives {rlen} bytes; with {n} bytes sent by rank {} every rank must send {n} and receive {}", self.rank, size * n),
                ));
            }
        }
        for q in 0..size {
            let src = self.slot(q).0 as *const u8;
            // SAFETY: rank q's send buffer is alive and unchanged until the closing barrier.
            unsafe { ptr::copy_nonoverlapping(src, recv.as_mut_ptr().add(q * n), n) };
        }
        self.sync()
    }

    fn all_to_all_v_bytes(
        &self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut Vec<u8>,
    ) -> Result<Vec<usize>, CommError> {
        let size = self.shared.size;
        check_counts(self.rank, size, send, send_counts).map_err(|e| self.fail(e))?;
        self.enter(
            tag(K_ALLTOALLV, 0, 0),
            send.as_ptr() as usize,
            send.len(),
            send_counts.as_ptr() as usize,
        )?;
        let me = self.rank;
        let mut recv_counts = vec![0usize; size];
        let mut offsets = vec![0usize; size];
        for q in 0..size {
            let counts = self.slot(q).2 as *const usize;
            // SAFETY: rank q's count slice has `size` entries (checked by rank q before entering)
            // and stays alive and unchanged until the closing barrier.
            let counts = unsafe { std::slice::from_raw_parts(counts, size) };
            recv_counts[q] = counts[me];
            offsets[q] = counts[..me].iter().sum();
        }
        recv.clear();
        recv.resize(recv_counts.iter().sum(), 0);
        let mut at = 0;
        for q in 0..size {
            let src = self.slot(q).0 as *const u8;
            // SAFETY: rank q's send buffer holds sum(counts) bytes and is alive until the barrier.
            unsafe {
                ptr::copy_nonoverlapping(
                    src.add(offsets[q]),
                    recv.as_mut_ptr().add(at),
                    recv_counts[q],
                )
            };
            at += recv_counts[q];
        }
        self.sync()?;
        Ok(recv_counts)
    }

    fn abort(&self, code: i32) -> ! {
        let msg = format!("rank {} aborted the job (exit code {code})", self.rank);
        self.shared.poison(self.rank, msg.clone());
        crate::eprint_flush(&format!("lockstep: {msg}"));
        std::process::exit(code)
    }
}

/// The first failure of a replica group: which rank failed and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaFailure {
    /// The rank that failed first.
    pub rank: usize,
    /// Its error message or panic payload.
    pub message: String,
}

impl fmt::Display for ReplicaFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "replica rank {} failed: {}", self.rank, self.message)
    }
}

impl std::error::Error for ReplicaFailure {}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        format!("panicked: {s}")
    } else if let Some(s) = payload.downcast_ref::<String>() {
        format!("panicked: {s}")
    } else {
        "panicked".to_string()
    }
}

/// Runs `replica` on `replicas` threads (named `rank-0`, `rank-1`, ...), each with its own
/// [`ThreadComm`] rank of one group, and returns their results in rank order.
///
/// If any replica returns an error or panics, the group is poisoned at once, so peers
/// blocked in (or later entering) a collective return [`CommError::PeerFailed`] instead of
/// waiting; the result is then the first failure, naming its rank.
///
/// Errors: [`ReplicaFailure`] with the failing rank and its message (`{:#}` of the error).
pub fn run_replicas<T, E, F>(replicas: usize, replica: F) -> Result<Vec<T>, ReplicaFailure>
where
    T: Send,
    E: fmt::Display,
    F: Fn(ThreadComm) -> Result<T, E> + Sync,
{
    let comms = ThreadComm::group(replicas);
    let shared = comms[0].shared.clone();
    let results: Vec<Option<T>> = std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let replica = &replica;
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("rank-{}", comm.rank))
                    .stack_size(16 << 20)
                    .spawn_scoped(scope, move || {
                        let rank = comm.rank;
                        match catch_unwind(AssertUnwindSafe(|| replica(comm))) {
                            Ok(Ok(v)) => Some(v),
                            Ok(Err(e)) => {
                                shared.poison(rank, format!("{e:#}"));
                                None
                            }
                            Err(payload) => {
                                shared.poison(rank, panic_message(payload.as_ref()));
                                None
                            }
                        }
                    })
                    .expect("cannot spawn a replica thread")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(None))
            .collect()
    });
    if let Some((rank, message)) = shared.failure() {
        return Err(ReplicaFailure { rank, message });
    }
    Ok(results
        .into_iter()
        .map(|r| r.expect("a replica without failure returned a value"))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::CommExt;
    use std::time::{Duration, Instant};

    #[test]
    fn chunks_cover_everything_once() {
        for n in [0usize, 1, 15, 16, 17, 1000, 4099] {
            for size in 1..5 {
                let mut covered = 0;
                let mut prev = 0;
                for c in 0..size {
                    let (lo, hi) = chunk(n, size, c);
                    assert_eq!(lo, prev);
                    assert!(hi >= lo);
                    covered += hi - lo;
                    prev = hi;
                }
                assert_eq!(covered, n);
            }
        }
    }

    #[test]
    fn panicking_replica_releases_peers_quickly() {
        let t0 = Instant::now();
        let err = run_replicas(3, |comm: ThreadComm| -> Result<(), CommError> {
            if comm.rank() == 1 {
                std::thread::sleep(Duration::from_millis(50));
                panic!("injected failure");
            }
            // Ranks 0 and 2 wait for rank 1 forever unless the barrier is poisoned.
            comm.barrier()?;
            comm.barrier()
        })
        .unwrap_err();
        assert_eq!(err.rank, 1);
        assert!(err.message.contains("injected failure"), "{err}");
        assert!(t0.elapsed() < Duration::from_secs(10));
    }

    #[test]
    fn erroring_replica_names_its_rank() {
        let err = run_replicas(2, |comm: ThreadComm| -> Result<u64, String> {
            if comm.rank() == 0 {
                return Err("chief could not open its output".into());
            }
            comm.all_reduce_scalar(1u64, ReduceOp::Sum)
                .map_err(|e| e.to_string())
        })
        .unwrap_err();
        assert_eq!(err.rank, 0);
        assert!(err.to_string().contains("rank 0"));
        assert!(err.message.contains("chief could not open"));
    }

    #[test]
    fn mismatched_collectives_are_detected() {
        let err = run_replicas(2, |comm: ThreadComm| -> Result<(), CommError> {
            if comm.rank() == 0 {
                comm.barrier()
            } else {
                comm.all_reduce_scalar(1.0f64, ReduceOp::Sum).map(|_| ())
            }
        })
        .unwrap_err();
        assert!(err.message.contains("collective mismatch"), "{err}");
    }

    #[test]
    fn unequal_reduce_lengths_are_an_error_not_a_crash() {
        let err = run_replicas(2, |comm: ThreadComm| -> Result<(), CommError> {
            let mut v = vec![1.0f32; 10 + comm.rank()];
            comm.all_reduce(&mut v, ReduceOp::Sum)
        })
        .unwrap_err();
        assert!(err.message.contains("same length"), "{err}");
    }

    #[test]
    fn float_sums_are_bitwise_identical_on_all_ranks() {
        let out = run_replicas(3, |comm: ThreadComm| -> Result<Vec<f32>, CommError> {
            let mut v: Vec<f32> = (0..5000)
                .map(|i| ((i * 7 + comm.rank() * 13) as f32).sin() * 1e-3 + 1.0)
                .collect();
            comm.all_reduce(&mut v, ReduceOp::Sum)?;
            Ok(v)
        })
        .unwrap();
        let bits = |v: &Vec<f32>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&out[0]), bits(&out[1]));
        assert_eq!(bits(&out[0]), bits(&out[2]));
    }

    #[test]
    fn inline_and_shared_memory_reductions_sum_in_rank_order() {
        let value = |r: usize, i: usize| ((i * 7 + r * 13) as f32).sin() * 1e-3 + 1.0;
        let lengths = [1usize, 31, 63, 64, 65, 1000, 4099];
        run_replicas(3, |comm: ThreadComm| -> Result<(), String> {
            for _round in 0..50 {
                for &n in &lengths {
                    let mut v: Vec<f32> = (0..n).map(|i| value(comm.rank(), i)).collect();
                    comm.all_reduce(&mut v, ReduceOp::Sum)
                        .map_err(|e| e.to_string())?;
                    for (i, &got) in v.iter().enumerate() {
                        let want = (value(0, i) + value(1, i)) + value(2, i);
                        if got.to_bits() != want.to_bits() {
                            return Err(format!("n {n}, element {i}: {got} != {want}"));
                        }
                    }
                    let mut m = vec![comm.rank() as f64 - 1.0; n.min(40)];
                    comm.all_reduce(&mut m, ReduceOp::Max)
                        .map_err(|e| e.to_string())?;
                    if m.iter().any(|&x| x != 1.0) {
                        return Err(format!("max of {} f64: {m:?}", m.len()));
                    }
                }
            }
            Ok(())
        })
        .unwrap_or_else(|f| panic!("{f}"));
    }
}
