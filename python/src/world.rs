//! The process's [`World`] (launch, communicator) for the calls that run jobs: serial,
//! thread replicas, or one MPI rank per process under `mpirun -n N python script.py`.
//!
//! Under an MPI launcher, lockstep owns MPI's initialisation: the first call that needs the
//! world initialises MPI (`MPI_Init_thread`, funneled), later calls reuse it, and
//! `lockstep._lockstep._finalize` (registered with `atexit` by the package) finalises it.
//! mpi4py, imported afterwards or with `mpi4py.rc.initialize = False`, uses that MPI
//! (README, "Python"). Outside a launcher each call gets a world of its own (one process).

use crate::errors::{exception, Kind};
use lockstep_comm::launch::ComputeKind;
use lockstep_comm::World;
use pyo3::prelude::*;
use std::cell::RefCell;

thread_local! {
    /// The MPI world, on the thread that initialised MPI (funneled: only it calls MPI).
    static MPI_WORLD: RefCell<Option<World>> = const { RefCell::new(None) };
}

/// Whether MPI was initialised by this module in this process (on any thread).
static MPI_STARTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Runs `f` with the world of this process: under an MPI launcher the one world (created on
/// first use, on this thread), else a serial world of its own.
///
/// Errors: the world cannot be created (malformed launcher variables, MPI initialisation),
/// or MPI was initialised on another thread; and `f`'s errors.
pub(crate) fn with_world<T>(py: Python<'_>, f: impl FnOnce(&World) -> PyResult<T>) -> PyResult<T> {
    let launch = lockstep_comm::launch::detect_launch().map_err(crate::errors::from_error)?;
    if !launch.is_mpi_launch() {
        let world = World::init(ComputeKind::Cpu, true).map_err(crate::errors::from_error)?;
        return f(&world);
    }
    let have = MPI_WORLD.with(|w| w.borrow().is_some());
    if !have {
        if MPI_STARTED.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(exception(
                Kind::Run,
                "MPI was initialised by lockstep on another thread; call lockstep's jobs from that thread (MPI is funneled: one thread calls it)",
            ));
        }
        let world = crate::detached(py, || World::init(ComputeKind::Cpu, true))
            .map_err(crate::errors::from_error)?;
        MPI_STARTED.store(true, std::sync::atomic::Ordering::SeqCst);
        MPI_WORLD.with(|w| *w.borrow_mut() = Some(world));
    }
    MPI_WORLD.with(|w| {
        let guard = w.borrow();
        let world = guard.as_ref().expect("the MPI world was created above");
        f(world)
    })
}

/// This process's rank and the number of ranks (initialising MPI under a launcher).
#[pyfunction]
fn _rank_and_size(py: Python<'_>) -> PyResult<(usize, usize)> {
    with_world(py, |w| Ok((w.comm().rank(), w.comm().size())))
}

/// Finalises MPI if lockstep initialised it (registered with `atexit`; a no-op otherwise).
#[pyfunction]
fn _finalize() {
    let world = MPI_WORLD.with(|w| w.borrow_mut().take());
    drop(world);
}

/// Makes the MPI library's symbols global (`RTLD_GLOBAL`), as mpi4py does: Open MPI loads
/// its components as plugins that resolve symbols of `libmpi`, which an extension module
/// loaded by Python (`RTLD_LOCAL`) does not export. `RTLD_NOLOAD` only promotes the copy
/// this module already linked; nothing is loaded when it is absent.
fn promote_libmpi() {
    #[cfg(target_os = "linux")]
    for name in [
        c"libmpi.so.40",
        c"libmpi.so.20",
        c"libmpi.so.12",
        c"libmpi.so",
    ] {
        // SAFETY: dlopen with RTLD_NOLOAD takes a NUL-terminated name and loads nothing; the
        // handle (a reference on an already loaded library) is deliberately kept.
        let handle = unsafe {
            libc::dlopen(
                name.as_ptr(),
                libc::RTLD_NOW | libc::RTLD_GLOBAL | libc::RTLD_NOLOAD,
            )
        };
        if !handle.is_null() {
            break;
        }
    }
}

/// Adds this module's functions and makes libmpi global.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    promote_libmpi();
    m.add_function(wrap_pyfunction!(_rank_and_size, m)?)?;
    m.add_function(wrap_pyfunction!(_finalize, m)?)?;
    Ok(())
}
