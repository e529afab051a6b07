//! Running a training job on the process group: serial, one thread per replica, or one MPI
//! process per replica, as the plan says.
//!
//! [`run_job`] validates everything that does not need the output directory first (the
//! model can be built, the launch matches the config, the run fits in this machine's memory)
//! and, under MPI, makes every rank agree on the verdict ([`agree_on_validation`]) before any
//! rank touches an output.

use crate::config::{plan, EngineConfig, Plan, Strategy};
use crate::engine::{no_trainable_parameters, train, EngineOptions, TrainSummary};
use crate::{BatchSource, Model, TrainError};
use lockstep_comm::{run_replicas, CommExt, Communicator, ReduceOp, World};
use lockstep_core::memory::MemoryEstimate;

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

/// Makes every rank of `comm` agree on a validation step that each rank ran on its own: if
/// any rank failed, every rank returns an error that [`TrainError::is_agreed`] marks, the
/// lowest failing rank its own ([`TrainError::Refused`]) and every other rank
/// [`TrainError::RefusedByPeer`] naming it, so exactly one rank reports the reason and all
/// may leave through `MPI_Finalize` without waiting for each other. One process (`size`
/// 1): the result unchanged.
///
/// Errors: as described, or [`TrainError::Comm`] when the agreement itself fails.
pub fn agree_on_validation<T>(
    comm: &dyn Communicator,
    local: Result<T, TrainError>,
) -> Result<T, TrainError> {
    if comm.size() == 1 {
        return local;
    }
    let mine = if local.is_err() {
        comm.rank() as u64
    } else {
        u64::MAX
    };
    let first = comm.all_reduce_scalar(mine, ReduceOp::Min)?;
    match local {
        Ok(v) if first == u64::MAX => Ok(v),
        Err(e) if first == comm.rank() as u64 => Err(TrainError::Refused(Box::new(e))),
        _ => Err(TrainError::RefusedByPeer {
            rank: first as usize,
        }),
    }
}

/// The memory of one training replica: the model's estimate for `local_batch` samples
/// ([`Model::memory_estimate`]) plus the engine's f32 buffers per trainable parameter (the
/// gradient, the accumulated gradient when `training.gradient_updates_per_optimizer_step`
/// is above 1, and the optimizer's state: two for Adam, one for SGD).
pub fn replica_memory_estimate(
    model: &dyn Model,
    local_batch: usize,
    cfg: &EngineConfig,
) -> MemoryEstimate {
    let mut estimate = model.memory_estimate(local_batch);
    let n = model.trainable().len() as u64;
    let slots = match cfg.optimizer.kind {
        crate::optim::OptimizerKind::Adam { .. } => 2,
        crate::optim::OptimizerKind::Sgd { .. } => 1,
    };
    let buffers = 1 + u64::from(cfg.accumulation > 1) + slots;
    estimate.add(
        "gradients and optimizer state",
        n.saturating_mul(4 * buffers),
    );
    estimate
}

/// Refuses a run that does not fit in this machine's memory: the model's estimate for its
/// local batch, plus the engine's gradient and optimizer buffers, times the replicas that
/// share this machine ([`Plan::replicas_on_this_machine`]).
///
/// Errors: [`TrainError::Memory`] naming the need, the parts, the available memory and the
/// keys that drive it.
pub fn check_memory(model: &dyn Model, plan: &Plan, cfg: &EngineConfig) -> Result<(), TrainError> {
    let estimate = replica_memory_estimate(model, plan.local_batch, cfg);
    let why = match plan.strategy {
        Some(Strategy::Threads) => "thread replicas in this process",
        Some(Strategy::Mpi) => "MPI ranks on this node",
        None => "replicas",
    };
    estimate
        .times(plan.replicas_on_this_machine as u64, why)
        .check_here("this training run")?;
    Ok(())
}

/// Builds this rank's model, plans the distribution and checks the memory (no output yet).
fn validate<M: Model, S: BatchSource>(
    world: &World,
    cfg: &EngineConfig,
    opts: &EngineOptions,
    build: &impl ReplicaFactory<M, S>,
) -> Result<(M, S, Plan), TrainError> {
    if let Some(f) = opts
        .fault
        .filter(|f| f.fires(crate::testing::FaultPoint::Validation, 0, 0))
    {
        return Err(TrainError::Injected {
            what: f.to_string(),
            rank: world.comm().rank(),
        });
    }
    let (model, source) = build(world.comm().rank()).map_err(TrainError::Build)?;
    if model.trainable().is_empty() {
        return Err(no_trainable_parameters());
    }
    let cores = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1);
    let separable = model.sample_separable();
    let synchronized = !separable && model.synchronizes_batch_statistics();
    let mut plan = plan(cfg, &world.launch, cores, separable || synchronized)?;
    if synchronized && plan.replicas > 1 {
        plan.warnings.push(format!(
            "warning: the loss couples the samples of a batch (BatchNorm); the {} replicas sum its batch statistics over the global batch (SyncBatchNorm: one all-reduce per layer in the forward and one in the backward pass); LayerNorm needs no communication",
            plan.replicas
        ));
    }
    check_memory(&model, &plan, cfg)?;
    Ok((model, source, plan))
}

/// Validates the run against the launch and this machine (before any output; every MPI rank
/// agrees on the verdict), then trains: serially or under MPI on `world`'s communicator, or
/// on `plan.replicas` threads with a `ThreadComm` for the threads strategy.
///
/// Errors: every [`TrainError`]; validation failures under MPI are agreed errors
/// ([`TrainError::is_agreed`]); a failed thread replica is reported as
/// [`TrainError::PeerFailed`] naming its rank.
pub fn run_job<M: Model, S: BatchSource>(
    world: &World,
    cfg: &EngineConfig,
    opts: &EngineOptions,
    build: impl ReplicaFactory<M, S>,
) -> Result<TrainSummary, TrainError> {
    let validated = validate(world, cfg, opts, &build);
    let (mut model, mut source, plan) = agree_on_validation(world.comm(), validated)?;
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
