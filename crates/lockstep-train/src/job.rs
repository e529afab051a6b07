//! Running a training job on the process group: serial, one thread per replica, or one MPI
//! process per replica, as the plan says.

use crate::config::{plan, EngineConfig, Strategy};
use crate::engine::{train, TrainOptions, TrainSummary};
use crate::{BatchSource, Model, TrainError};
use lockstep_comm::{run_replicas, Communicator, World};

/// Builds the model replica of a rank and its batch source; called once for planning and
/// once per replica (on the replica's own thread for the threads strategy) with the replica's
/// rank. Every call must build the same model (the startup broadcast then makes them equal).
pub trait ReplicaFactory<M: Model, S: BatchSource>:
    Fn(usize) -> anyhow::Result<(M, S)> + Sync
{
}
impl<M: Model, S: BatchSource, F: Fn(usize) -> anyhow::Result<(M, S)> + Sync> ReplicaFactory<M, S>
    for F
{
}

/// Validates the distribution against the launch (before any output), then trains:
/// serially or under MPI on `world`'s communicator, or on `plan.replicas` threads with a
/// `ThreadComm` for the threads strategy.
///
/// Errors: every [`TrainError`]; a failed thread replica is reported as
/// [`TrainError::PeerFailed`] naming its rank.
pub fn run_job<M: Model, S: BatchSource>(
    world: &World,
    cfg: &EngineConfig,
    opts: &TrainOptions,
    build: impl ReplicaFactory<M, S>,
) -> Result<TrainSummary, TrainError> {
    let (mut model, mut source) = build(world.comm().rank()).map_err(TrainError::Build)?;
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let plan = plan(cfg, &world.launch, cores, model.sample_separable())?;
    if plan.strategy == Some(Strategy::Threads) {
        drop(model);
        let mut results = run_replicas(plan.replicas, |comm| {
            let (mut m, mut s) = build(comm.rank()).map_err(TrainError::Build)?;
            train(&comm, cfg, &plan, &mut m, &mut s, opts)
        })
        .map_err(|f| TrainError::PeerFailed {
            rank: f.rank,
            message: f.message,
        })?;
        return Ok(results.swap_remove(0));
    }
    train(world.comm(), cfg, &plan, &mut model, &mut source, opts)
}
