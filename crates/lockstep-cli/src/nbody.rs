//! `lockstep nbody CONFIG` (serial or under `mpirun`/`srun`: the same config, the particles
//! sharded over the ranks) and `lockstep bench nbody` (lockstep-nbody).

use anyhow::Result;
use lockstep_comm::World;
use lockstep_nbody::{
    bench_nbody, bench_nbody_ranks, config::run_nbody_config_on, BenchOptions, FmmParams,
    RunOptions,
};
use std::path::PathBuf;

/// Options of `lockstep nbody`.
#[derive(Debug, clap::Args)]
pub struct NbodyArgs {
    /// The N-body config (units, initial conditions, forces, integrator, time, output).
    pub config: PathBuf,
    /// Replace output.dir of the config.
    #[arg(long)]
    pub output_dir: Option<PathBuf>,
    /// Print only the final summary.
    #[arg(long)]
    pub quiet: bool,
}

/// Runs the simulation on every rank of the world.
pub fn run(args: &NbodyArgs, world: &World) -> Result<()> {
    use std::io::IsTerminal;
    let opts = RunOptions {
        progress: world.comm().is_chief() && !args.quiet && std::io::stderr().is_terminal(),
        quiet: args.quiet || !world.comm().is_chief(),
        output_dir: args.output_dir.clone(),
    };
    let s = run_nbody_config_on(world.comm(), &args.config, &opts)?;
    // Without --quiet the library has printed the table and the summary already.
    if args.quiet && world.comm().is_chief() {
        println!(
            "{} particles on {} rank(s), {} steps in {:.2} s: energy drift {:.3e} (max {:.3e}), momentum drift {:.3e}, {} snapshot files",
            s.num_total,
            world.comm().size(),
            s.steps,
            s.wall_seconds,
            s.energy_drift,
            s.max_energy_drift,
            s.momentum_drift,
            s.files.len()
        );
    }
    Ok(())
}

/// Options of `lockstep bench nbody`.
#[derive(Debug, clap::Args)]
pub struct BenchNbodyArgs {
    /// Rank counts for the sharded benchmark, e.g. `1,2` (ThreadComm ranks sharing the cores);
    /// without it: FMM and direct evaluations per second and the comparison with fmm3dpy.
    #[arg(long, value_delimiter = ',')]
    pub ranks: Option<Vec<usize>>,
    /// Particles (sharded benchmark).
    #[arg(long, default_value_t = 1_000_000)]
    pub n: usize,
    /// Timed evaluations per configuration (the best is reported).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Skip the comparison with fmm3dpy (Flatiron FMM3D through python3).
    #[arg(long)]
    pub no_fmm3d: bool,
}

/// Runs the benchmark; the library prints its table.
pub fn bench(args: &BenchNbodyArgs) -> Result<()> {
    match &args.ranks {
        Some(ranks) => {
            bench_nbody_ranks(ranks, args.n, FmmParams::default(), args.repeats.max(1))?;
        }
        None => {
            let opts = BenchOptions {
                repeats: args.repeats.max(1),
                fmm3d: !args.no_fmm3d,
                ..BenchOptions::default()
            };
            let report = bench_nbody(&opts)?;
            if let Some(note) = report.fmm3d_note {
                println!("note: {note}");
            }
        }
    }
    Ok(())
}
