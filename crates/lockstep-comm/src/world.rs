//! The process group of one program run: the launch, the bound device and the communicator
//! (MPI under `mpirun`/`mpiexec`/`srun`, else a one-rank group).

use crate::launch::{
    bind_device, detect_launch, unused_gpus_warning, BindError, ComputeKind, Device, LaunchEnv,
    LaunchError,
};
use crate::{CommError, Communicator, SelfComm};
use thiserror::Error;

/// Why the process group could not be set up.
#[derive(Debug, Error)]
pub enum WorldError {
    /// A malformed launcher variable.
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// The device binding cannot be satisfied.
    #[error("rank {rank}: {cause}")]
    Bind {
        /// The launch rank.
        rank: usize,
        /// Why.
        cause: BindError,
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
    /// For a CPU model started with GPUs in `CUDA_VISIBLE_DEVICES` (and no `--cpu`): the
    /// warning that they stay unused. The caller prints it once, on the chief
    /// ([`World::warn_unused_gpus`]).
    pub unused_gpus: Option<String>,
    /// This machine's host name (`/proc/sys/kernel/hostname`, `unknown` where it cannot be
    /// read): error messages of a job across hosts name the host of the failing rank.
    pub host: String,
    comm: Box<dyn Communicator>,
}

impl World {
    /// Detects the launch, binds the device for a model that computes on `kind`
    /// (`force_cpu`, the `--cpu` flag: bind no GPU and do not warn) and creates the
    /// communicator: `MpiComm` under an MPI launcher, else `SelfComm`.
    ///
    /// Only a [`ComputeKind::Gpu`] model reads `CUDA_VISIBLE_DEVICES` to bind one token per
    /// node-local rank; a CPU model binds [`Device::Cpu`] on every rank, whatever the list.
    ///
    /// Errors: [`WorldError`] for malformed launcher variables, an impossible GPU binding
    /// (naming the rank and the `CUDA_VISIBLE_DEVICES` list), MPI initialisation failure, or an
    /// MPI launch of a build without the `mpi` feature.
    pub fn init(kind: ComputeKind, force_cpu: bool) -> Result<World, WorldError> {
        let launch = detect_launch()?;
        let visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
        let device = bind_device(launch.local_rank, visible.as_deref(), kind, force_cpu).map_err(
            |source| WorldError::Bind {
                rank: launch.rank,
                cause: source,
            },
        )?;
        let unused_gpus = if force_cpu {
            None
        } else {
            unused_gpus_warning(visible.as_deref(), kind)
        };
        let comm: Box<dyn Communicator> = if launch.is_mpi_launch() {
            mpi_world(&launch)?
        } else {
            Box::new(SelfComm)
        };
        Ok(World {
            launch,
            device,
            unused_gpus,
            host: host_name(),
            comm,
        })
    }

    /// Prints the [`unused_gpus`](World::unused_gpus) warning to stderr on the chief (launch
    /// rank 0) only, so a job warns once however many ranks it has.
    pub fn warn_unused_gpus(&self) {
        if let Some(w) = &self.unused_gpus {
            if self.launch.rank == 0 {
                crate::eprint_flush(&format!("lockstep: warning: {w}"));
            }
        }
    }

    /// The communicator.
    pub fn comm(&self) -> &dyn Communicator {
        &*self.comm
    }

    /// Where an error message says it comes from: `error on rank R (host H)` in a job of
    /// several ranks (which may span hosts), plain `error` in a serial run.
    pub fn error_origin(&self) -> String {
        if self.comm.size() > 1 {
            format!("error on rank {} (host {})", self.comm.rank(), self.host)
        } else {
            "error".to_string()
        }
    }

    /// Reports a fatal error with this rank and ends the job: `MPI_Abort` when there are
    /// other ranks (so none of them waits for this one), else an ordinary exit with status 1.
    pub fn fail(&self, err: &dyn std::fmt::Display) -> ! {
        crate::eprint_flush(&format!("lockstep: {}: {err:#}", self.error_origin()));
        if self.comm.size() > 1 {
            self.comm.abort(1)
        }
        std::process::exit(1)
    }
}

/// This machine's host name, as the kernel has it (in a UTS namespace, the namespace's).
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_string())
        .ok()
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

#[cfg(feature = "mpi")]
fn mpi_world(_launch: &LaunchEnv) -> Result<Box<dyn Communicator>, WorldError> {
    Ok(Box::new(crate::MpiComm::init()?))
}

#[cfg(not(feature = "mpi"))]
fn mpi_world(launch: &LaunchEnv) -> Result<Box<dyn Communicator>, WorldError> {
    Err(WorldError::NoMpi(launch.launcher.to_string()))
}
