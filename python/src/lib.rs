//! `lockstep._lockstep`, the extension module of the `lockstep` Python package: thin
//! bindings over the library crates. They convert arrays and options and delegate; every
//! result is computed by the same functions the `lockstep` command calls
//! ([`lockstep_nbody`], [`lockstep_npe`], [`lockstep_snn`]). The typed, documented Python
//! names live in `python/lockstep/*.py`; this module's names start with an underscore or are
//! re-exported there.
//!
//! What the bindings guarantee:
//! - errors become Python exceptions carrying the library's message (module `errors`), never a
//!   crash of the interpreter (a panic becomes PyO3's `PanicException`; under MPI a panic
//!   aborts the job, as in the command, so that no rank waits forever);
//! - long calls release the GIL (`detached`) and stop on Ctrl-C with `KeyboardInterrupt`:
//!   sampling and log-probabilities at the next chunk, training, simulations and forces at the
//!   library's next check (`interruptible`);
//! - arrays cross without copies where the layout allows: inputs are read in place, results
//!   are written straight into the NumPy arrays returned.

mod errors;
mod nbody;
mod npe;
mod snn;
mod world;

use pyo3::prelude::*;

/// The extension's Rust code allocates through mimalloc rather than the process's `malloc`.
/// The library's hot loops (burn's tensors per chunk of samples, the FMM's per-evaluation
/// buffers) allocate and free large blocks over and over; under glibc's default thresholds
/// those come from fresh `mmap`s or a trimmed heap each time, page faults included, which
/// made sampling about 14% slower in Python than in the `lockstep` command (that sets
/// `mallopt` thresholds in its `main`, which an extension must not do to its host process).
/// mimalloc keeps freed pages for reuse within the extension only: Python's and NumPy's
/// allocations are untouched, and arrays handed to NumPy (`into_pyarray`) are freed by the
/// same allocator that made them.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Runs `f` with the GIL released (`Python::detach`), on this thread.
///
/// `f` may hold references that are not `Send` (the library's models, the MPI world): the
/// closure runs on the calling thread, before `detach` returns, so nothing crosses a thread;
/// the `Send` bound of `detach` only keeps Python objects out of the closure, and callers
/// pass none in (only plain Rust values and slices of NumPy buffers the caller keeps alive).
pub(crate) fn detached<T, F: FnOnce() -> T>(py: Python<'_>, f: F) -> T {
    /// `F` and `T` asserted `Send` for [`detached`] (see its safety argument).
    struct AssertSend<X>(X);
    // SAFETY: `Python::detach` runs the closure on the calling thread and returns its result
    // there; the values never reach another thread.
    unsafe impl<X> Send for AssertSend<X> {}
    let call = AssertSend(f);
    let out = py.detach(move || {
        let call = call;
        AssertSend((call.0)())
    });
    out.0
}

/// Runs `f` with the GIL released (as [`detached`]) so that Ctrl-C stops it cleanly: while
/// `f` runs, SIGINT sets lockstep's interrupt flag ([`lockstep_core::interrupt`]) instead of
/// Python's, the library stops at its next check (training after the update, with a
/// checkpoint; a simulation before writing; the N-body between force phases and steps), and
/// the call raises `KeyboardInterrupt` carrying the library's message. `f`'s own result
/// otherwise (`Ok(result)`).
///
/// Only where Python itself would raise `KeyboardInterrupt`: on the main thread, with
/// `signal.default_int_handler` installed for SIGINT. Elsewhere (another thread, a handler
/// of the user's, SIGINT ignored) `f` runs as with [`detached`] and the user's handling
/// applies when it returns.
///
/// Errors: `KeyboardInterrupt` when SIGINT arrived during the call.
pub(crate) fn interruptible<T, E: std::fmt::Display, F: FnOnce() -> Result<T, E>>(
    py: Python<'_>,
    f: F,
) -> PyResult<Result<T, E>> {
    let guard = sigint::Guard::install(py);
    if guard.is_some() {
        lockstep_core::interrupt::clear();
    }
    let out = detached(py, f);
    let Some(guard) = guard else {
        return Ok(out);
    };
    drop(guard);
    if !lockstep_core::interrupt::requested() {
        return Ok(out);
    }
    lockstep_core::interrupt::clear();
    let message = match &out {
        Err(e) => format!("{e:#}"),
        Ok(_) => "interrupted (Ctrl-C); the call had just finished, its result is dropped".into(),
    };
    Err(pyo3::exceptions::PyKeyboardInterrupt::new_err(message))
}

/// SIGINT routed to [`lockstep_core::interrupt::request`] for the length of a call.
mod sigint {
    use pyo3::prelude::*;

    /// The signal handler: one atomic store (async-signal-safe).
    extern "C" fn on_sigint(_signal: libc::c_int) {
        lockstep_core::interrupt::request();
    }

    /// Python's SIGINT disposition, put back when dropped.
    pub(crate) struct Guard {
        previous: libc::sigaction,
    }

    impl Guard {
        /// Installs [`on_sigint`] when this is Python's main thread and SIGINT has Python's
        /// default handler (which raises `KeyboardInterrupt`); `None` otherwise.
        pub(crate) fn install(py: Python<'_>) -> Option<Guard> {
            let python_would_raise = || -> PyResult<bool> {
                let threading = py.import("threading")?;
                let main = threading
                    .call_method0("main_thread")?
                    .is(&threading.call_method0("current_thread")?);
                let signal = py.import("signal")?;
                let handler = signal.call_method1("getsignal", (libc::SIGINT,))?;
                Ok(main && handler.is(&signal.getattr("default_int_handler")?))
            };
            if !python_would_raise().unwrap_or(false) {
                return None;
            }
            // SAFETY: sigaction with zero-initialised structs (a valid empty mask and no
            // flags but SA_RESTART); the handler only stores an atomic.
            unsafe {
                let mut action: libc::sigaction = std::mem::zeroed();
                action.sa_sigaction = on_sigint as *const () as libc::sighandler_t;
                libc::sigemptyset(&mut action.sa_mask);
                action.sa_flags = libc::SA_RESTART;
                let mut previous: libc::sigaction = std::mem::zeroed();
                if libc::sigaction(libc::SIGINT, &action, &mut previous) != 0 {
                    return None;
                }
                Some(Guard { previous })
            }
        }
    }

    impl Drop for Guard {
        fn drop(&mut self) {
            // SAFETY: restores the disposition saved by `install`.
            unsafe {
                libc::sigaction(libc::SIGINT, &self.previous, std::ptr::null_mut());
            }
        }
    }
}

/// Whether Python has a pending signal (Ctrl-C): reacquires the GIL for a moment and runs
/// Python's signal handlers, returning their exception (`KeyboardInterrupt`). Call between
/// chunks of a long detached call.
pub(crate) fn check_signals() -> PyResult<()> {
    Python::attach(|py| py.check_signals())
}

/// The extension module.
#[pymodule]
fn _lockstep(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    nbody::register(m)?;
    npe::register(m)?;
    snn::register(m)?;
    world::register(m)?;
    Ok(())
}
