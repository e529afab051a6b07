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
//! - long calls release the GIL (`detached`); sampling and log-probabilities stop at the
//!   next chunk on Ctrl-C (`KeyboardInterrupt`);
//! - arrays cross without copies where the layout allows: inputs are read in place, results
//!   are written straight into the NumPy arrays returned.

mod errors;
mod nbody;
mod npe;
mod snn;
mod world;

use pyo3::prelude::*;

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
