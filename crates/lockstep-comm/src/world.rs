//! The process group of one `lockstep` invocation: serial or MPI, chosen from the launch.

use anyhow::Result;
use lockstep_comm::launch::{bind_device, detect_launch, Device, LaunchEnv};
use lockstep_comm::{Communicator, SelfComm};

/// The communicator of this process plus how it was launched and which device it computes on.
pub struct World {
    /// How the process was started.
    pub launch: LaunchEnv,
    /// The device bound to this rank.
    pub device: Device,
    comm: Box<dyn Communicator>,
}

impl World {
    /// Detects the launch, binds the device (`force_cpu` = `--cpu`) and creates the
    /// communicator: MPI under `mpirun`/`mpiexec`/`srun`, else a one-rank group.
    ///
    /// Errors: malformed launcher variables, an impossible device binding, an MPI launch of a
    /// build without the `mpi` feature, MPI initialisation failure.
    pub fn init(force_cpu: bool) -> Result<World> {
        let launch = detect_launch()?;
        let device = bind_device(
            launch.local_rank,
            std::env::var("CUDA_VISIBLE_DEVICES").ok().as_deref(),
            force_cpu,
        )
        .map_err(|e| anyhow::anyhow!("rank {}: {e}", launch.rank))?;
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
    /// other ranks (so none of them waits for this one), else an ordinary non-zero exit.
    pub fn fail(&self, err: &anyhow::Error) -> ! {
        let rank = self.comm.rank();
        lockstep_comm::eprint_flush(&format!("lockstep: error on rank {rank}: {err:#}"));
        if self.comm.size() > 1 {
            self.comm.abort(1)
        }
        std::process::exit(1)
    }
}

#[cfg(feature = "mpi")]
fn mpi_world(_launch: &LaunchEnv) -> Result<Box<dyn Communicator>> {
    Ok(Box::new(lockstep_comm::MpiComm::init()?))
}

#[cfg(not(feature = "mpi"))]
fn mpi_world(launch: &LaunchEnv) -> Result<Box<dyn Communicator>> {
    anyhow::bail!(
        "this process was started by {} but lockstep was built without the `mpi` feature; rebuild with default features or run without mpirun",
        launch.launcher
    )
}
