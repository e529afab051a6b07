//! `lockstep nbody CONFIG` (serial or under `mpirun`/`srun`: the same config, the particles
//! sharded over the ranks).

use anyhow::Result;
use lockstep_comm::World;
use lockstep_nbody::{config::run_nbody_config_on, RunOptions};
use std::path::PathBuf;

/// Options of `lockstep nbody`.
#[derive(Debug, clap::Args)]
pub struct NbodyArgs {
    /// The N-body config (units, initial conditions, forces, integrator, time, output).
    pub config: PathBuf,
    /// Replace output.dir of the config (default: ./nbody_output in the current directory).
    #[arg(long)]
    pub output_dir: Option<PathBuf>,
    /// Replace an earlier lockstep nbody output in the output folder (output.overwrite_output_dir
    /// = true); only files lockstep nbody wrote are deleted.
    #[arg(long)]
    pub overwrite: bool,
    /// Print only the final summary.
    #[arg(long)]
    pub quiet: bool,
    /// For a quick try: the particle count (initial_conditions.n of generated initial
    /// conditions).
    #[arg(allow_negative_numbers = true, long)]
    pub n: Option<u64>,
    /// For a quick try: run only the first STEPS steps of the config's time array (the same
    /// step size, an earlier end).
    #[arg(allow_negative_numbers = true, long)]
    pub steps: Option<u64>,
}

/// Runs the simulation on every rank of the world.
pub fn run(args: &NbodyArgs, world: &World) -> Result<()> {
    let opts = RunOptions {
        // A bar on a terminal, else a progress line about every tenth of the run.
        progress: world.comm().is_chief() && !args.quiet,
        quiet: args.quiet || !world.comm().is_chief(),
        output_dir: args.output_dir.clone(),
        overwrite: args.overwrite,
        n: crate::flags::positive("--n", args.n)?,
        steps: crate::flags::positive("--steps", args.steps)?.map(|k| k as usize),
    };
    let s = run_nbody_config_on(world.comm(), &args.config, &opts)?;
    // Without --quiet the library has printed the table and the summary already.
    if args.quiet && world.comm().is_chief() {
        println!(
            "{} particles on {} rank(s), {} steps in {:.2} s: energy drift {:.3e} (max {:.3e}), momentum drift {:.3e}, {} snapshot files of rank 0{}",
            s.num_total,
            world.comm().size(),
            s.steps,
            s.wall_seconds,
            s.energy_drift,
            s.max_energy_drift,
            s.momentum_drift,
            s.files.len(),
            match &s.output_dir {
                Some(d) => format!(
                    "; outputs in {}",
                    std::path::absolute(d).unwrap_or_else(|_| d.clone()).display()
                ),
                None => String::new(),
            }
        );
    }
    Ok(())
}
