//! `lockstep bench ...`: the benchmarks. Each reports ratios measured in the same run, one
//! file per benchmark (its arguments, measurement and printout); [`mpi_worker`] starts the
//! benchmarks' own worker processes and [`npy`] exchanges arrays with the peers' Python
//! scripts. Nothing here is part of a library crate's API.

mod allreduce;
mod bptt;
mod c2st;
mod gpu_traffic;
mod mpi_worker;
mod nbody;
mod nbody_gpu;
mod npe;
mod npy;
mod scaling;
mod simulate;

use anyhow::Result;
use clap::Subcommand;
use lockstep_comm::World;

/// The benchmarks, `lockstep bench NAME`.
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// All-reduce time and bandwidth of ThreadComm and MpiComm vs MPI_Allreduce and a single-core memcpy, 16 B to 256 MiB.
    Allreduce(allreduce::AllreduceArgs),
    /// BPTT seconds per step and memory, with and without segmented recompute.
    Bptt(bptt::BpttArgs),
    /// Training throughput of 1 vs N replicas (threads and MPI), one core per replica.
    Scaling(scaling::ScalingArgs),
    /// N-body force evaluations/s (FMM, direct, vs fmm3dpy), on the GPU with --device gpu, or sharded over --ranks 1,2.
    Nbody(nbody::BenchNbodyArgs),
    /// Forward simulation of the 450-cell BMTK network: neuron-steps/s, synaptic events/s, ratio to NEST.
    Simulate(simulate::BenchSimulateArgs),
    /// NPE training: s/step of the Dingo-shaped network vs PyTorch eager, pack/unpack cost, 1 vs N replicas.
    Npe(npe::BenchNpeArgs),
    /// NPE posterior accuracy on sbibm's two_moons and slcp: C2ST against the reference posteriors, vs the sbi package.
    C2st(c2st::BenchC2stArgs),
}

impl BenchCommand {
    /// Whether this process is one of the ranks a benchmark started itself under mpirun
    /// (`--mpi-worker`): such a process runs under mpirun by design and reports no unused GPUs.
    /// Every other benchmark process runs alone (it starts its own MPI jobs).
    pub fn is_mpi_worker(&self) -> bool {
        match self {
            BenchCommand::Allreduce(a) => a.mpi_worker,
            BenchCommand::Scaling(a) => a.mpi_worker,
            BenchCommand::Npe(a) => a.mpi_worker,
            BenchCommand::Bptt(_)
            | BenchCommand::Nbody(_)
            | BenchCommand::Simulate(_)
            | BenchCommand::C2st(_) => false,
        }
    }

    /// Runs the benchmark and prints its tables.
    ///
    /// Errors: whatever the benchmark reports (bad arguments, a failed worker job or peer
    /// script), with its causes.
    pub fn run(&self, world: &World) -> Result<()> {
        match self {
            BenchCommand::Allreduce(args) => allreduce::run(args, world),
            BenchCommand::Simulate(args) => simulate::run(args),
            BenchCommand::Scaling(args) => scaling::run(args, world),
            BenchCommand::Bptt(args) => bptt::run(args),
            BenchCommand::Nbody(args) if args.device != lockstep_nbody::DeviceRequest::Cpu => {
                nbody_gpu::run(args)
            }
            BenchCommand::Nbody(args) => nbody::run(args),
            BenchCommand::Npe(args) => npe::run(args, world),
            BenchCommand::C2st(args) => c2st::run(args, world),
        }
    }
}
