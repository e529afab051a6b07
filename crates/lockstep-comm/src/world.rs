//! The process group of one program run: the launch, the bound device and the communicator
//! (MPI under `mpirun`/`mpiexec`/`srun`, else a one-rank group).

use crate::launch::{bind_device, detect_launch, BindError, Device, LaunchEnv, LaunchError};
use crate::{CommError, Communicator, SelfComm};
use thiserror::Error;

/// Why the process group could not be set up.
#[derive(Debug, Error)]
pub enum WorldError {
    /// A malformed launcher variable.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// The device binding cannot be satisfied.
    #[error("rank {rank}: {source}")]
    Bind {
        /// The launch rank.
        rank: usize,
        /// Why.
        source: BindError,
    },
    /// MPI could not be initialised.
    #[error(transparent)]
    Comm(#[from] CommError),
    /// Started by an MPI launcher, but built without the `mpi` feature.
    #[error("this process was started by {0} but was built without the `mpi` feature; rebuild with default features or run without mpirun")]
    NoMpi(String),
}

/// The communicator of this process plus how it was launched and which device it computes on.
pub struct World {
    /// How the process was started.
    pub launch: LaunchEnv,
    /// The device bound to this rank.
    pub device: Device,
    comm: Box<dyn Communicator>,
}

impl World {
    /// Detects the launch, binds the device (`force_cpu`: bind no GPU) and creates the
    /// communicator: `MpiComm` under an MPI launcher, else `SelfComm`.
    ///
    /// Errors: [`WorldError`] for malformed launcher variables, an impossible device binding
    /// (naming the rank and the `CUDA_VISIBLE_DEVICES` list), MPI initialisation failure, or an
    /// MPI launch of a build without the `mpi` feature.
    pub fn init(force_cpu: bool) -> Result<World, WorldError> {
        let launch = detect_launch()?;
        let device = bind_device(
            launch.local_rank,
            std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(),
            force_cpu,
        )
        .map_err(|source| WorldError::Bind {
            rank: launch.rank,
            source,
        })?;
        let comm: Box<dyn Communicator> = if launch.is_mpi_launch() {
            mpi_world(&launch)?
        } else {
            Box::new(SelfComm)
        };
        Ok(World {
            launch,
            device,
            comm,
        })
    }

    /// The communicator.
    pub fn comm(&self) -> &dyn Communicator {
        &*self.comm
    }

    /// Reports a fatal error with this rank and ends the job: `MPI_Abort` when there are
    /// other ranks (so none of them waits for this one), else an ordinary exit with status 1.
    pub fn fail(&self, err: &dyn std::fmt::Display) -> ! {
        let rank = self.comm.rank();
        crate::eprint_flush(&format!("lockstep: error on rank {rank}: {err:#}"));
        if self.comm.size() > 1 {
            self.comm.abort(1)
        }
        std::process::exit(1)
    }
}

#[cfg(feature = "mpi")]
fn mpi_world(_launch: &LaunchEnv) -> Result<Box<dyn Communicator>, WorldError> {
    Ok(Box::new(crate::MpiComm::init()?))
}

#[cfg(not(feature = "mpi"))]
fn mpi_world(launch: &LaunchEnv) -> Result<Box<dyn Communicator>, WorldError> {
    Err(WorldError::NoMpi(launch.launcher.to_string()))
}
