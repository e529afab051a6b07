//! `lockstep train CONFIG`: trains a SONATA point-neuron network with BPTT, serially or
//! sample-parallel (threads or MPI), as `run.distribution` says. The job itself is
//! [`lockstep_snn::train_config`] (shared with the Python package).

use anyhow::Result;
use lockstep_comm::World;
pub use lockstep_snn::{asks_for_gpu, prepare, Overrides};
use std::path::PathBuf;

/// Options of `lockstep train`.
#[derive(Debug, clap::Args)]
pub struct TrainArgs {
    /// The training config (SONATA/BMTK style: manifest, networks, inputs, run, training, output).
    pub config: PathBuf,
    /// Continue from this checkpoint (any replica count).
    #[arg(long)]
    pub resume: Option<PathBuf>,
    /// Override training.optimizer_updates (e.g. a short smoke run).
    #[arg(allow_negative_numbers = true, long)]
    pub updates: Option<u64>,
    /// Override output.output_dir.
    #[arg(long)]
    pub output_dir: Option<PathBuf>,
    /// Override output.overwrite_output_dir to true.
    #[arg(long)]
    pub overwrite: bool,
}

/// Reads the config, applies the command-line overrides, and trains. Under MPI every rank
/// reads the config and the ranks agree on any error before anything is written.
///
/// Errors: config errors (agreed across ranks, see [`lockstep_train::TrainError::is_agreed`])
/// and every error of the run.
pub fn run(args: &TrainArgs, world: &World) -> Result<()> {
    let overrides = Overrides {
        updates: args.updates,
        output_dir: args.output_dir.clone(),
        overwrite: args.overwrite,
        ..Overrides::default()
    };
    // --cpu wins over run.device (the run says so).
    let force_cpu = crate::flags::cpu_only() && asks_for_gpu(&args.config);
    if force_cpu && world.comm().is_chief() {
        println!(
            "--cpu: computes on the CPU, in place of run.device in {}",
            args.config.display()
        );
    }
    lockstep_snn::train_config(
        world,
        &args.config,
        &overrides,
        args.resume.clone(),
        force_cpu,
    )?;
    Ok(())
}
